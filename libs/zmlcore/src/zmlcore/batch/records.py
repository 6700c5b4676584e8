"""How a batch record changes (pure: each function takes the current record and returns the
next one, or None for "no change"; :meth:`zmlcore.batch.store.BatchStore.update_batch` applies
it by compare-and-set).

The statuses are OpenAI's::

    validating -> in_progress -> finalizing -> completed | expired | cancelled
         |             |
         |             +-> cancelling -> finalizing -> cancelled
         +-> failed (the input cannot run)     (cancel in validating: cancelling too)

A batch whose window ends while lines are left is finalized as ``expired``: what finished is
kept, the rest is written to the error file as ``batch_expired``.
"""

from __future__ import annotations

import msgspec

from zmlcore.errors import BatchStateError
from zmlcore.messages.batch import BatchErrorItem, BatchRecord

_replace = msgspec.structs.replace

#: Statuses in which lines may still be dispatched.
RUNNING = frozenset({"validating", "in_progress"})


def cancel(rec: BatchRecord, now: int) -> BatchRecord | None:
    """``POST /v1/batches/{id}/cancel``: stop dispatching; lines in flight finish (their
    results are kept), the rest are written as ``batch_cancelled``."""
    if rec.status in ("cancelling", "cancelled"):
        return None
    if rec.status not in RUNNING:
        raise BatchStateError(f"batch {rec.id} is {rec.status}: only a validating or in-progress batch can be cancelled")
    return _replace(rec, status="cancelling", cancelling_at=now)


def started(rec: BatchRecord, *, total: int, shards: int, model: str, now: int) -> BatchRecord | None:
    """Validated and split into ``shards``: the lines may run (unless it was cancelled meanwhile)."""
    if rec.shards and rec.status != "validating":
        return None  # a repeated start (the first one's ack was lost): nothing new
    status = "in_progress" if rec.status == "validating" else rec.status
    return _replace(rec, status=status, total=total, shards=shards, model=model,
                    in_progress_at=now if status == "in_progress" else rec.in_progress_at)


def failed(rec: BatchRecord, errors: list[BatchErrorItem], now: int) -> BatchRecord | None:
    if rec.status not in RUNNING and rec.status != "cancelling":
        return None
    return _replace(rec, status="failed", failed_at=now, errors=errors)


def progress(rec: BatchRecord, shard: int, counts: list[int], *, done: bool) -> BatchRecord | None:
    """One shard's counts so far (overwritten, never added to); ``done``: the shard is over."""
    key = str(shard)
    if rec.progress.get(key) == counts and (not done or shard in rec.done):
        return None
    new_done = sorted({*rec.done, shard}) if done else rec.done
    return _replace(rec, progress={**rec.progress, key: counts}, done=new_done)


def all_done(rec: BatchRecord) -> bool:
    """Every shard is over: the batch can be written out."""
    return len(rec.done) >= rec.shards


def stopping(rec: BatchRecord, now: float) -> str:
    """Why no more lines of the batch should start ("" = they may): ``cancelled`` or ``expired``."""
    if rec.status in ("cancelling", "cancelled"):
        return "cancelled"
    if rec.status == "expired" or now >= rec.expires_at:
        return "expired"
    if rec.status in ("failed", "completed", "finalizing"):
        return rec.status
    return ""


def finalizing(rec: BatchRecord, now: int) -> BatchRecord | None:
    if rec.status == "finalizing" or rec.status in ("completed", "expired", "cancelled", "failed"):
        return None
    return _replace(rec, status="finalizing", finalizing_at=now, cancelling_at=rec.cancelling_at)


def outcome(rec: BatchRecord, all_answered: bool) -> str:
    """The status a batch ends in once written out."""
    if rec.cancelling_at is not None:
        return "cancelled"
    if not all_answered:
        return "expired"
    return "completed"


def finished(rec: BatchRecord, *, status: str, output_file_id: str | None, error_file_id: str | None,
             progress: dict[str, list[int]], now: int) -> BatchRecord | None:
    if rec.status in ("completed", "expired", "cancelled", "failed"):
        return None
    stamp = {"completed": {"completed_at": now}, "expired": {"expired_at": now},
             "cancelled": {"cancelled_at": now}}[status]
    return _replace(rec, status=status, output_file_id=output_file_id, error_file_id=error_file_id,
                    progress=progress, done=list(range(rec.shards)), **stamp)
