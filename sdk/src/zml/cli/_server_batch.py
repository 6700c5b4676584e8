"""`zml batch --server`: the same JSONL file run by the Batch API instead of by this process.

The file is uploaded and a batch created (``POST /v1/files``, ``POST /v1/batches``); the command
then follows it with a progress bar and writes every line's result to ``--output`` (OpenAI's
output lines, then its error lines: one row per ``custom_id``). The batch runs on the server:
Ctrl-C stops following, not the batch, and ``zml batch --server --follow BATCH_ID --output ...``
picks it up again (``zml batches`` lists them).

Input lines: OpenAI batch request lines (``custom_id``, ``method``, ``url``, ``body``) are sent
as they are; anything ``zml batch`` reads (a prompt, ``{"prompt": ...}``, ``{"messages": ...}``
with ``id`` and request fields) becomes such a line, ``custom_id`` its ``id`` or its index.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zml._batch_models import Batch
from zml._client import Client
from zml._core import batches as core
from zml._errors import BadRequestError
from zml.cli._batchio import Progress, read_items
from zml.cli._common import client_kwargs


def _openai_lines(path: str) -> bytes | None:
    """The file as it is, when every line is already an OpenAI batch request line."""
    try:
        data = open(path, "rb").read()
    except OSError as exc:
        raise BadRequestError(f"cannot read {path}: {exc.strerror or exc}") from exc
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
    except ValueError:
        return None
    if rows and all(isinstance(r, dict) and "custom_id" in r and "body" in r for r in rows):
        return data
    return None


def endpoint_of(rows: list[dict[str, Any]], chat: bool) -> str:
    """One endpoint for the whole batch: chat when any item has messages (or --chat)."""
    if chat or any("messages" in r for r in rows):
        return core.ENDPOINTS["chat"]
    if all("input" in r for r in rows):
        return core.ENDPOINTS["embedding"]
    return core.ENDPOINTS["completion"]


def submit(client: Client, args: argparse.Namespace) -> Batch:
    data = _openai_lines(args.input)
    policy = args.policy or args.routing
    meta = {"source": "zml batch --server"}
    if data is not None:
        endpoint = json.loads(data.splitlines()[0]).get("url", core.ENDPOINTS["chat"])
    else:
        items = read_items(args.input, args.chat)
        endpoint = endpoint_of(items, args.chat)
        defaults = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
        data = core.request_lines(items, endpoint=endpoint, model=args.model, defaults=defaults)
    file = client.files.create(data, filename=args.input.rsplit("/", 1)[-1])
    return client.batches.create(file.id, endpoint, metadata=meta, policy=policy)


def follow(client: Client, batch_id: str, output: str, poll_s: float) -> int:
    batch = client.batches.retrieve(batch_id)
    progress = Progress(batch.request_counts.total, 0)
    print(f"zml batch: {batch.id} ({batch.status}); Ctrl-C stops following, not the batch "
          f"(`zml batch --server --follow {batch.id} --output {output}` picks it up)", file=sys.stderr, flush=True)
    try:
        while not batch.done:
            progress.total = batch.request_counts.total
            progress.set(batch.request_counts.completed, batch.request_counts.failed)
            time.sleep(poll_s)
            batch = client.batches.retrieve(batch_id)
    except KeyboardInterrupt:
        progress.finish()
        print(f"zml batch: stopped following; {batch.id} goes on on the server", file=sys.stderr)
        return 130
    progress.total = batch.request_counts.total
    progress.set(batch.request_counts.completed, batch.request_counts.failed)
    progress.finish()
    rows = 0
    with open(output, "wb") as out:
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                data = client.files.content(file_id)
                out.write(data)
                rows += sum(1 for line in data.splitlines() if line.strip())
    print(f"zml batch: {batch.id} {batch.status}: {batch.request_counts.completed} completed, "
          f"{batch.request_counts.failed} failed; {rows} rows in {output}", file=sys.stderr)
    if batch.status != "completed":
        for err in batch.errors:
            print(f"zml batch: {err.get('code')}: {err.get('message')}", file=sys.stderr)
        return 2
    return 1 if batch.request_counts.failed else 0


def run(args: argparse.Namespace) -> int:
    with Client(**client_kwargs(args), model=args.model) as client:
        if args.follow:
            return follow(client, args.follow, args.output, args.poll)
        if not args.input:
            raise BadRequestError("--server needs --input FILE (or --follow BATCH_ID)")
        batch = submit(client, args)
        if args.no_wait:
            print(batch.id)
            return 0
        return follow(client, batch.id, args.output, args.poll)
