"""`zml infer`: one request, printed as it arrives with `--stream`."""

from __future__ import annotations

import argparse
import json
import sys

from zml._client import Client
from zml._errors import BadRequestError
from zml.cli._common import add_client_args, add_request_args, client_kwargs, fmt_s, request_kwargs


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("infer", help="run one inference request",
                       description="Run one inference request; the text goes to stdout, routing to stderr.")
    add_request_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (sent as a chat message unless --completion)")
    src.add_argument("--messages", help="chat messages as a JSON list")
    p.add_argument("--completion", action="store_true", help="send --prompt to /v1/completions as is")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the whole reply JSON")
    add_client_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    kwargs = request_kwargs(args)
    if args.messages is not None:
        try:
            kwargs["messages"] = json.loads(args.messages)
        except ValueError as exc:
            raise BadRequestError(f"--messages is not valid JSON: {exc}") from exc
    elif args.completion:
        kwargs["prompt"] = args.prompt
    else:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    with Client(**client_kwargs(args)) as client:
        if args.stream:
            # The usage chunk at the end is where a stream's token count comes from (OpenAI's way).
            with client.infer_stream(args.model, stream_options={"include_usage": True}, **kwargs) as stream:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            r, meta, retries = stream.routing, stream.metadata, stream.metrics.retries
            tokens = str(stream.usage.total_tokens) if stream.usage.total_tokens else "-"  # none reported
        else:
            result = client.infer(args.model, **kwargs)
            if args.json:
                print(json.dumps(result.raw, indent=2))
            else:
                print(result.text)
            r, meta, retries = result.routing, result.metadata, result.metrics.retries
            tokens = str(meta.total_tokens)
    if r is not None:
        print(f"zml: node={r.node_id} type={r.accelerator_type} family={r.family} policy={r.policy} "
              f"queue={r.queue_depth_at_dispatch} ttft={fmt_s(meta.time_to_first_token)} "
              f"tokens={tokens} retries={retries}", file=sys.stderr)
    return 0
