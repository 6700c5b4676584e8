"""A batch whose every shard is over: its output and error files (``finalizing`` ->
``completed`` | ``expired`` | ``cancelled``).

Every line ends up in exactly one of the two files: the results stream holds at most one
result per line (the first), each goes to the output file (answered 200) or the error file;
a line with no result (its batch cancelled, or its window over) goes to the error file as
``batch_cancelled`` / ``batch_expired``. The counts are recounted from what is written, so a
crash that left a shard's progress stale does not show.

Idempotent: the files' ids derive from the batch's, so a finalization cut short by a crash
and run again by another runner writes the same files over, and a batch already ended is left
as it is. The batch's results are purged only once its record says where its files are.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time

from zmlcore.batch import objects, records
from zmlcore.batch.store import BatchStore
from zmlcore.errors import NotFoundError
from zmlcore.messages.batch import TERMINAL, BatchRecord, BatchTask, FileRecord, input_line_decoder
from zml_batch import metrics
from zml_batch.starter import lines_of

log = logging.getLogger("zml.batch")
#: Output bytes kept in memory before spilling to a temporary file.
SPOOL_BYTES = 8 * 1024 * 1024


def file_id_of(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: derived, so writing it again replaces it."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


async def finalize(store: BatchStore, task: BatchTask, ttl_s: float) -> BatchRecord | None:
    try:
        rec = await store.batch(task.owner, task.batch_id)
    except NotFoundError:
        return None
    if rec.status in TERMINAL:
        return rec
    now = int(time.time())
    rec = await store.update_batch(rec.owner, rec.id, lambda r: records.finalizing(r, now))
    if rec.status in TERMINAL:
        return rec
    out = tempfile.SpooledTemporaryFile(SPOOL_BYTES)
    err = tempfile.SpooledTemporaryFile(SPOOL_BYTES)
    try:
        seen: set[int] = set()
        spilled: list[str] = []
        ok = failed = prompt = completion = 0
        async for r in store.results(rec.id):
            if r.line in seen or r.line >= rec.total:
                continue
            seen.add(r.line)
            if r.spilled:
                spilled.append(r.spilled)
            good, text = objects.output_line(rec.id, r)
            (out if good else err).write(text)
            ok += good
            failed += not good
            prompt += r.prompt_tokens
            completion += r.completion_tokens
        status = records.outcome(rec, all_answered=len(seen) >= rec.total)
        if len(seen) < rec.total:
            code, message = objects.UNANSWERED[status]
            index = 0
            async for raw in lines_of(store, rec.input_file_id):
                if not raw.strip():
                    continue
                if index not in seen:
                    cid = input_line_decoder.decode(raw).custom_id
                    err.write(objects.unanswered_line(rec.id, index, cid, code, message))
                    failed += 1
                    metrics.LINES(status).inc()  # expired or cancelled, never sent
                index += 1
        stamp = int(time.time())
        output_id = await _put(store, rec, out, "output", stamp, ttl_s)
        error_id = await _put(store, rec, err, "error", stamp, ttl_s)
        progress = {"all": [ok, failed, prompt, completion]}
        rec = await store.update_batch(rec.owner, rec.id, lambda r: records.finished(
            r, status=status, output_file_id=output_id, error_file_id=error_id, progress=progress, now=stamp))
        await store.drop_results(rec.id, spilled)
        log.info("batch %s %s: %d answered, %d failed (%d without an answer)", rec.id, status, ok, failed,
                 rec.total - len(seen))
        return rec
    finally:
        out.close()
        err.close()


async def _put(store: BatchStore, rec: BatchRecord, data: tempfile.SpooledTemporaryFile[bytes], kind: str,
               now: int, ttl_s: float) -> str | None:
    size = data.tell()
    if not size:
        return None
    data.seek(0)
    file_id = file_id_of(rec.id, kind)
    name = f"{rec.id}_{kind}.jsonl"
    await store.put_file(FileRecord(id=file_id, owner=rec.owner, filename=name, bytes=size, created_at=now,
                                    purpose="batch_output", expires_at=int(now + ttl_s), batch_id=rec.id),
                         data)
    return file_id
