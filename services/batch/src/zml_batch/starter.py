"""A new batch: check its input against the batch and cut it into shards (``validating`` ->
``in_progress``), or fail it with OpenAI's ``errors`` list.

Idempotent: a runner that dies mid-split leaves the start task to another, which cuts the
same shards again; JetStream drops the repeats (same ``Nats-Msg-Id`` within the dedup window),
and a record that already counts its shards is not cut again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from zmlcore import subjects
from zmlcore.batch import records, shards
from zmlcore.batch.store import MESSAGE_ROOM, BatchStore
from zmlcore.errors import NotFoundError
from zmlcore.messages.batch import BatchErrorItem, BatchRecord, BatchTask, ShardTask

log = logging.getLogger("zml.batch")
_encode = msgspec.json.encode
#: Shard messages published at once (each waits for its JetStream ack).
PUBLISH_WINDOW = 16


async def start(store: BatchStore, task: BatchTask, shard_lines: int) -> BatchRecord | None:
    """Validate and split one batch; the record after it (None: the batch is gone)."""
    try:
        rec = await store.batch(task.owner, task.batch_id)
    except NotFoundError:
        return None
    if rec.shards or rec.status not in ("validating", "cancelling"):
        return rec  # done before (this task's ack was lost)
    now = int(time.time())
    try:
        file = await store.file(rec.owner, rec.input_file_id)
    except NotFoundError:
        return await _fail(store, rec, [BatchErrorItem(code="invalid_file", param="input_file_id",
                                                       message=f"input file {rec.input_file_id} no longer exists")])
    if any(url != rec.endpoint for url in file.endpoints):  # every line's url, known since the upload
        others = sorted(set(file.endpoints) - {rec.endpoint})
        return await _fail(store, rec, [BatchErrorItem(
            code="mismatched_endpoint", param="endpoint",
            message=f"the batch's endpoint is {rec.endpoint} but its input file has lines for {', '.join(others)}")])
    max_bytes = (store.nc.max_payload or 1024 * 1024) - MESSAGE_ROOM
    cutter = shards.Cutter(max_lines=shard_lines, max_bytes=max_bytes)
    pending: set[asyncio.Future[bool]] = set()
    count = 0

    async def publish(cut: shards.Cut) -> None:
        nonlocal pending, count
        msg = ShardTask(batch_id=rec.id, owner=rec.owner, shard=cut.number, first=cut.first,
                        lines=[msgspec.Raw(x) for x in cut.lines])
        pending.add(asyncio.ensure_future(store.publish(subjects.batch_shard(rec.id), _encode(msg),
                                                        f"shard:{rec.id}:{cut.number}")))
        count += 1
        if len(pending) >= PUBLISH_WINDOW:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for d in done:
                d.result()

    async for raw in lines_of(store, rec.input_file_id):
        full = cutter.add(raw)
        if full is not None:
            await publish(full)
    last = cutter.end()
    if last is not None:
        await publish(last)
    if pending:
        await asyncio.gather(*pending)
    lines = cutter.lines
    model = file.models[0] if len(file.models) == 1 else ""
    new = await store.update_batch(rec.owner, rec.id,
                                   lambda r: records.started(r, total=lines, shards=count, model=model, now=now))
    log.info("batch %s: %d lines in %d shards (%s)", rec.id, lines, count, new.status)
    return new


async def _fail(store: BatchStore, rec: BatchRecord, errors: list[BatchErrorItem]) -> BatchRecord:
    log.info("batch %s failed validation: %s", rec.id, errors[0].message)
    return await store.update_batch(rec.owner, rec.id, lambda r: records.failed(r, errors, int(time.time())))


async def lines_of(store: BatchStore, file_id: str) -> AsyncIterator[bytes]:
    """A stored file's lines (blank ones included), one chunk of the file in memory at a time."""
    carry = b""
    async for chunk in store.read_file(file_id):
        done, carry = shards.split_lines(chunk, carry)
        for line in done:
            yield line
    if carry:
        yield carry
