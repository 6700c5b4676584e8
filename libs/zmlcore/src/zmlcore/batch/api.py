"""The Batch API's operations, whatever carries them (the gateway's HTTP handlers call these;
``zml_gateway.batches`` only parses HTTP and writes answers).

Each takes the caller's owner identity (an API key's, or ``anonymous`` on a gateway without
keys) and returns OpenAI's JSON object; errors are ZMLErrors with stable codes (a missing or
someone else's id: NOT_FOUND; a bad file: INVALID_FILE naming its lines; limits: 413,
QUOTA_EXCEEDED, STORAGE_FULL).

    api = BatchApi(store, cfg, policy_known=lambda name: ...)
    file = await api.upload(owner, "in.jsonl", "batch", chunks)
    batch = await api.create_batch(owner, body_bytes)
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from zmlcore import subjects
from zmlcore.batch import ids, objects, records
from zmlcore.batch.lines import LineChecker, LineLimits
from zmlcore.batch.store import MESSAGE_ROOM, BatchStore
from zmlcore.config import ZMLConfig, window_seconds
from zmlcore.errors import (
    BadRequestError,
    InvalidFileError,
    NotFoundError,
    QuotaExceededError,
    RequestTooLargeError,
)
from zmlcore.messages.batch import ENDPOINTS, BatchRecord, BatchTask, FileRecord
from zmlcore.messages.validate import clip

_encode = msgspec.json.encode
#: Upload bytes kept in memory before the spool goes to a temporary file.
SPOOL_BYTES = 8 * 1024 * 1024
#: OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
MAX_KEY = 64
MAX_VALUE = 512


class BatchCreate(msgspec.Struct, kw_only=True):
    """``POST /v1/batches``'s body."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    #: OpenAI's expiry of the output files: accepted, bounded by [batch] file_ttl_s.
    output_expires_after: dict[str, Any] | None = None


_create = msgspec.json.Decoder(BatchCreate)


class BatchApi:
    def __init__(self, store: BatchStore, cfg: ZMLConfig, *, policy_known: Callable[[str], bool]) -> None:
        self.store = store
        self.cfg = cfg
        self.bc = cfg.batch
        self.policy_known = policy_known
        models = cfg.model_names()
        aliases = {a for mc in cfg.models.values() for a in mc.aliases}
        self._models = models | aliases

    def model_known(self, name: str) -> bool:
        return name in self._models

    def line_limits(self) -> LineLimits:
        """A line is one request: it must fit in one NATS message as well as under the limit."""
        payload = (self.store.nc.max_payload or 1024 * 1024) - MESSAGE_ROOM
        return LineLimits(max_line_bytes=min(self.bc.max_line_bytes, payload), max_lines=self.bc.max_lines,
                          max_json_depth=self.cfg.defaults.max_json_depth)

    # --- files -----------------------------------------------------------------------------------
    async def begin_upload(self, owner: str, size: int | None = None) -> Upload:
        """An upload to feed as its bytes arrive (refused at once when the key holds its most
        files, or the announced ``size`` is over the limit)."""
        if size is not None and size > self.bc.max_file_bytes:
            raise RequestTooLargeError(f"a file of about {size} bytes is over the limit of {self.bc.max_file_bytes} "
                                       "bytes ([batch] max_file_bytes)")
        if len(await self.store.list_files(owner)) >= self.bc.max_files_per_owner:
            raise QuotaExceededError(f"this key holds {self.bc.max_files_per_owner} files, the most allowed: delete "
                                     "some (DELETE /v1/files/{id})")
        return Upload(self, owner)

    async def upload(self, owner: str, filename: str, purpose: str, chunks: AsyncIterator[bytes]) -> dict[str, Any]:
        """Store an input file whose bytes come from ``chunks`` (see :class:`Upload`)."""
        with await self.begin_upload(owner) as up:
            async for chunk in chunks:
                up.feed(chunk)
            return await up.finish(filename, purpose)

    async def file(self, owner: str, file_id: str) -> dict[str, Any]:
        return objects.file_object(await self._file(owner, file_id))

    async def _file(self, owner: str, file_id: str) -> FileRecord:
        if not ids.valid_id(file_id, ids.FILE_PREFIX):
            raise NotFoundError(f"no file {clip(file_id, 60)}")
        return await self.store.file(owner, file_id)

    async def files(self, owner: str, *, after: str | None, limit: int, order: str = "desc",
                    purpose: str | None = None) -> dict[str, Any]:
        recs = {r.id: r for r in await self.store.list_files(owner) if purpose is None or r.purpose == purpose}
        chosen, more = objects.page(list(recs), after, limit, newest_first=order != "asc")
        return objects.list_page([objects.file_object(recs[i]) for i in chosen], more)

    async def delete_file(self, owner: str, file_id: str) -> dict[str, Any]:
        await self._file(owner, file_id)
        await self.store.delete_file(owner, file_id)
        return objects.deleted_file(file_id)

    async def content(self, owner: str, file_id: str) -> tuple[FileRecord, AsyncIterator[bytes]]:
        rec = await self._file(owner, file_id)
        return rec, self.store.read_file(file_id)

    # --- batches ---------------------------------------------------------------------------------
    async def create_batch(self, owner: str, body: bytes, traceparent: str = "") -> dict[str, Any]:
        try:
            req = _create.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequestError(f"invalid batch: {clip(str(exc), 200)[1:-1]}") from None
        if req.endpoint not in ENDPOINTS:
            raise BadRequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {clip(req.endpoint, 60)}")
        if req.completion_window not in self.bc.completion_windows:
            raise BadRequestError(f"completion_window must be one of {', '.join(self.bc.completion_windows)}, "
                                  f"not {clip(req.completion_window, 20)}")
        meta = req.metadata or {}
        if len(meta) > MAX_METADATA or any(len(k) > MAX_KEY or len(v) > MAX_VALUE for k, v in meta.items()):
            raise BadRequestError(f"metadata holds at most {MAX_METADATA} pairs, keys up to {MAX_KEY} characters and "
                                  f"values up to {MAX_VALUE}")
        policy = meta.get("policy") or self.bc.policy
        if policy and not self.policy_known(policy):
            raise BadRequestError(f"metadata.policy: unknown policy {clip(policy, 60)} (a name from zml.toml's "
                                  "[policy] tables or a built-in)")
        file = await self._file(owner, req.input_file_id)
        if file.purpose != "batch":
            raise BadRequestError(f"file {req.input_file_id} is not a batch input (its purpose is {file.purpose})")
        if await self.store.active_batches(owner) >= self.bc.max_active_batches_per_owner:
            raise QuotaExceededError(f"this key has {self.bc.max_active_batches_per_owner} unfinished batches, the "
                                     "most allowed: wait for one to end, or cancel one")
        now = time.time()
        rec = BatchRecord(id=ids.new_batch_id(now), owner=owner, endpoint=req.endpoint,
                          input_file_id=req.input_file_id, completion_window=req.completion_window,
                          created_at=int(now), expires_at=int(now + window_seconds(req.completion_window)),
                          metadata=req.metadata, policy=policy, total=file.lines,
                          model=file.models[0] if len(file.models) == 1 else "", traceparent=traceparent)
        await self.store.create_batch(rec)
        await self.store.publish(subjects.BATCH_WORK_START, _encode(BatchTask(batch_id=rec.id, owner=owner)),
                                 f"start:{rec.id}")
        return objects.batch_object(rec)

    async def batch(self, owner: str, batch_id: str) -> dict[str, Any]:
        return objects.batch_object(await self._batch(owner, batch_id))

    async def _batch(self, owner: str, batch_id: str) -> BatchRecord:
        if not ids.valid_id(batch_id, ids.BATCH_PREFIX):
            raise NotFoundError(f"no batch {clip(batch_id, 60)}")
        return await self.store.batch(owner, batch_id)

    async def batches(self, owner: str, *, after: str | None, limit: int) -> dict[str, Any]:
        recs = {r.id: r for r in await self.store.list_batches(owner)}
        chosen, more = objects.page(list(recs), after, limit)
        return objects.list_page([objects.batch_object(recs[i]) for i in chosen], more)

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        await self._batch(owner, batch_id)
        now = int(time.time())
        rec = await self.store.update_batch(owner, batch_id, lambda r: records.cancel(r, now))
        try:  # the runners holding its shards hear of it now, not at their next progress write
            await self.store.nc.publish(subjects.BATCH_EVENTS, _encode(objects.event(rec, now)))
        except Exception:
            pass
        return objects.batch_object(rec)


class Upload:
    """One input file arriving: each piece is checked line by line (:mod:`zmlcore.batch.lines`)
    and spooled (memory, then a temporary file); :meth:`finish` stores it, or raises
    INVALID_FILE naming its bad lines. Past ``max_file_bytes`` :meth:`feed` raises 413 at once,
    so the rest of an oversized upload is never kept."""

    def __init__(self, api: BatchApi, owner: str) -> None:
        self.api = api
        self.owner = owner
        self.size = 0
        self.checker = LineChecker(api.line_limits(), api.model_known)
        self.spool = tempfile.SpooledTemporaryFile(SPOOL_BYTES)

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        limit = self.api.bc.max_file_bytes
        if self.size > limit:
            raise RequestTooLargeError(f"the file is over the limit of {limit} bytes ([batch] max_file_bytes)")
        self.checker.feed(data)
        self.spool.write(data)

    async def finish(self, filename: str, purpose: str) -> dict[str, Any]:
        if purpose != "batch":
            raise BadRequestError(f"purpose must be \"batch\" (the files this deployment keeps are batch inputs), "
                                  f"not {clip(purpose, 40)}", param="purpose")
        summary = self.checker.finish()
        if summary.errors:
            first = summary.errors[0]
            raise InvalidFileError(summary.message(), param=f"line {first.line}" if first.line else None)
        now = time.time()
        rec = FileRecord(id=ids.new_file_id(now), owner=self.owner, filename=clip_name(filename), bytes=self.size,
                         created_at=int(now), purpose="batch", expires_at=int(now + self.api.bc.file_ttl_s),
                         lines=summary.lines, endpoints=summary.endpoints, models=summary.models)
        self.spool.seek(0)
        await self.api.store.put_file(rec, self.spool)
        return objects.file_object(rec)

    def close(self) -> None:
        self.spool.close()

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def clip_name(filename: str) -> str:
    """A file name as stored and shown: no path, no control characters, at most 255 characters."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())
    return (name or "upload.jsonl")[:255]

