"""`zml batch`: a JSONL file of prompts in, a JSONL file of results out, resumable.

Each result row is written and flushed as it completes, so an interrupted run (Ctrl-C, a
crash, ``kill -9``) loses only the requests in flight. ``--resume`` keeps the rows already
done (dropping failed rows, duplicates and a torn last line), then runs only what is missing:
every input line ends up in the output exactly once.

Input lines: a JSON object with ``prompt`` or ``messages`` (plus optional ``id``, ``model``,
``max_tokens``... any ``infer()`` argument), a JSON string, or plain text (a prompt).

``--transcribe`` (or ``--translate``) runs audio files through ``transcribe_batch``: each line is
a file path (plain text or a JSON string; relative to the input file's folder) or a JSON object
with ``file`` (plus ``id``, ``model``, ``language``, ``prompt``, ``response_format``... any
``transcribe()`` argument). Its rows have ``text`` instead of ``output_text``; ``--resume`` works
the same.

``--server`` runs the file with the Batch API instead: uploaded, run by the batch runners on the
fleet's spare capacity (this process may go away), followed with a progress bar, and its results
written to ``--output`` as OpenAI's output lines (zml.cli._server_batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from zml._client import Client
from zml._errors import BadRequestError
from zml._models import InferResult, TranscriptionResult
from zml.cli._batchio import Progress, read_audio_items, read_items
from zml.cli._common import add_client_args, add_request_args, client_kwargs, parse_policy, request_kwargs

_ITEM_KEYS = {"prompt", "messages", "model", "max_tokens", "temperature", "policy", "routing", "accelerator_id",
              "response_format", "top_p", "stop", "seed", "timeout", "request_id", "max_completion_tokens"}
#: What an audio line may give ``transcribe()`` (the rest of its keys, ``id`` included, are kept out).
_AUDIO_KEYS = {"file", "model", "language", "prompt", "temperature", "response_format", "timestamp_granularities",
               "policy", "routing", "accelerator_id", "timeout", "request_id", "chunking_strategy", "include"}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("batch", help="run a JSONL file of prompts (resumable)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", help="prompts.jsonl (or OpenAI batch request lines, with --server)")
    p.add_argument("--output", required=True, help="results.jsonl (one row per input line, any order)")
    srv = p.add_argument_group("server-side (the Batch API: /v1/files, /v1/batches)")
    srv.add_argument("--server", action="store_true", help="submit the file as a batch the server runs, follow it "
                                                          "with a progress bar, then download its results")
    srv.add_argument("--follow", metavar="BATCH_ID", help="with --server: follow a batch submitted before")
    srv.add_argument("--no-wait", action="store_true", help="with --server: print the batch id and return")
    srv.add_argument("--poll", type=float, default=1.0, help="with --server: seconds between progress checks")
    p.add_argument("--resume", action="store_true", help="keep the rows already in --output, run the rest")
    p.add_argument("--max-parallel-requests", "-c", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--chat", action="store_true", help="send plain prompts as chat messages")
    audio = p.add_argument_group("audio (transcribe_batch)")
    audio.add_argument("--transcribe", action="store_true", help="the lines are audio files to transcribe")
    audio.add_argument("--translate", action="store_true", help="... to translate into English text")
    audio.add_argument("--language", help="with --transcribe: the audio's language (ISO-639-1, e.g. fr)")
    audio.add_argument("--response-format", choices=["json", "text", "srt", "verbose_json", "vtt"],
                       help="with --transcribe/--translate: the transcript's format (default json)")
    lim = p.add_argument_group("client-side rate limits")
    lim.add_argument("--rpm", type=float, help="requests per minute")
    lim.add_argument("--tpm", type=float, help="tokens per minute")
    lim.add_argument("--rpd", type=float, help="requests per day")
    lim.add_argument("--tpd", type=float, help="tokens per day")
    lim.add_argument("--max-request-burst", type=float, help="requests allowed at once above the rate")
    lim.add_argument("--max-token-burst", type=float, help="tokens allowed at once above the rate")
    add_request_args(p, model_required=False)
    add_client_args(p)
    p.set_defaults(func=run)


def load_done(path: str) -> tuple[dict[int, str], bool]:
    """Rows of a previous run that succeeded, by index, in file order (first wins), and whether
    the file holds anything else (failed rows, duplicates, a torn last line)."""
    done: dict[int, str] = {}
    if not os.path.exists(path):
        return done, False
    lines = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            lines += 1
            if not line.endswith("\n"):
                continue  # torn write of a killed run
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("index"), int) and "error" not in row:
                done.setdefault(row["index"], line)
    return done, lines != len(done)


def rewrite(path: str, lines: list[str]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(lines)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def result_row(index: int, item: dict[str, Any], result: InferResult | None, error: BaseException | None) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index}
    if "id" in item:
        row["id"] = item["id"]
    if error is not None:
        row["error"] = str(error)
        row["code"] = getattr(error, "code", type(error).__name__)
        return row
    assert result is not None
    row["output_text"] = result.text
    if result.output_parsed is not None:
        parsed = result.output_parsed
        row["output_parsed"] = parsed.model_dump() if hasattr(parsed, "model_dump") else parsed
    r = result.routing
    row["routing"] = {"node_id": r.node_id, "accelerator_type": r.accelerator_type, "family": r.family,
                      "policy": r.policy, "queue_depth_at_dispatch": r.queue_depth_at_dispatch,
                      "decision_id": r.decision_id}
    row["usage"] = {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
                    "total_tokens": result.usage.total_tokens}
    row["metrics"] = {"retries": result.metrics.retries, "latency_s": round(result.metrics.latency_s, 4),
                      "time_to_first_token": result.metadata.time_to_first_token}
    return row


def audio_row(index: int, item: dict[str, Any], result: TranscriptionResult | None,
              error: BaseException | None) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index}
    if "id" in item:
        row["id"] = item["id"]
    row["file"] = item["file"]
    if error is not None:
        row["error"] = str(error)
        row["code"] = getattr(error, "code", type(error).__name__)
        return row
    assert result is not None
    row["text"] = result.text
    if result.response_format != "json":
        row["response_format"] = result.response_format
    for key in ("language", "duration"):
        if getattr(result, key) is not None:
            row[key] = getattr(result, key)
    if result.segments:
        row["segments"] = result.segments
    if result.words:
        row["words"] = result.words
    r = result.routing
    row["routing"] = {"node_id": r.node_id, "accelerator_type": r.accelerator_type, "family": r.family,
                      "policy": r.policy, "queue_depth_at_dispatch": r.queue_depth_at_dispatch,
                      "decision_id": r.decision_id}
    row["metrics"] = {"retries": result.metrics.retries, "latency_s": round(result.metrics.latency_s, 4)}
    return row


def run(args: argparse.Namespace) -> int:
    if args.server or args.follow:
        from zml.cli import _server_batch

        return _server_batch.run(args)
    if not args.input:
        raise BadRequestError("--input is required (or --server --follow BATCH_ID)")
    audio = args.transcribe or args.translate
    if args.transcribe and args.translate:
        raise BadRequestError("--transcribe or --translate, not both")
    items = read_audio_items(args.input) if audio else read_items(args.input, args.chat)
    try:
        return _run(args, items)
    except OSError as exc:  # the output file: a clear line, not a traceback
        raise BadRequestError(f"cannot write {args.output}: {exc.strerror or exc}") from exc


def _run(args: argparse.Namespace, items: list[dict[str, Any]]) -> int:
    if args.resume:
        done, dirty = load_done(args.output)
        kept = {i: line for i, line in done.items() if i < len(items)}
        if dirty or len(kept) != len(done):  # leave a clean file untouched
            rewrite(args.output, list(kept.values()))
        done = kept
    else:
        done = {}
        rewrite(args.output, [])
    todo = [i for i in range(len(items)) if i not in done]
    audio = args.transcribe or args.translate
    common = _audio_kwargs(args) if audio else request_kwargs(args)
    progress = Progress(len(items), len(done))
    if not todo:
        progress.finish()
        return 0
    limits = {k: getattr(args, k) for k in ("rpm", "tpm", "rpd", "tpd", "max_request_burst", "max_token_burst")}
    out = open(args.output, "a", encoding="utf-8")
    try:
        with Client(**client_kwargs(args), model=args.model, max_parallel_requests=args.max_parallel_requests,
                    **{k: v for k, v in limits.items() if v is not None}) as client:

            def write(row: dict[str, Any], ok: bool) -> None:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                progress.update(ok)

            def save(pos: int, result: InferResult | None, error: BaseException | None) -> None:
                write(result_row(todo[pos], items[todo[pos]], result, error), error is None)

            def save_audio(pos: int, result: TranscriptionResult | None, error: BaseException | None) -> None:
                write(audio_row(todo[pos], items[todo[pos]], result, error), error is None)

            batch: Any
            if audio:
                batch = _audio_batch(client, args, [{**{k: v for k, v in items[i].items() if k in _AUDIO_KEYS},
                                                     "file": items[i]["_path"]} for i in todo], save_audio, common)
            else:
                batch = client.infer_batch(
                    [{k: v for k, v in items[i].items() if k in _ITEM_KEYS} for i in todo], on_result=save, **common,
                )
    finally:
        out.close()
        progress.finish()
    if batch.failed:
        codes = sorted({getattr(e, "code", type(e).__name__) for e in batch.errors if e is not None})
        print(f"zml batch: {batch.failed} of {len(todo)} requests failed ({', '.join(codes)}); "
              f"rerun with --resume to retry them", file=sys.stderr)
        return 1
    return 0




def _audio_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": parse_policy(args.policy), "routing": args.routing,
                           "accelerator_id": args.accelerator_id, "temperature": args.temperature,
                           "language": args.language if args.transcribe else None,
                           "response_format": args.response_format}
    return {k: v for k, v in out.items() if v is not None}


def _audio_batch(client: Client, args: argparse.Namespace, items: list[dict[str, Any]], save: Any,
                 common: dict[str, Any]) -> Any:
    if args.translate:  # translate(): no language; the rest as transcribe()'s
        def one(item: dict[str, Any]) -> TranscriptionResult:
            merged = {**common, **item}
            merged.pop("language", None)
            return client.translate(**merged)

        from zml._batch import audio_item, run_sync

        return run_sync(one, items, args.max_parallel_requests, save, audio_item)
    return client.transcribe_batch(items, on_result=save, max_parallel_requests=args.max_parallel_requests, **common)
