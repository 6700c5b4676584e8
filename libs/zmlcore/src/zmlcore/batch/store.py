"""The Batch API's JetStream storage, shared by the gateway's handlers and the batch runners.

    KV zml_batch_index        f.<owner>.<file id> -> FileRecord, b.<owner>.<batch id> -> BatchRecord
    object store zml_batch_files   the files' bytes, named by file id
    stream ZML_BATCH_WORK     work queue: zml.batch.work.start | shard.<batch> | final
    stream ZML_BATCH_RESULTS  zml.batch.result.<batch>.<shard>.<line>: one LineResult per line

A record's key names its owner (:func:`zmlcore.batch.ids.owner_token`): one owner's records
are one subject filter, and another owner asking for the same id finds no key (404, never
403: an id does not even leak its existence). Every bucket and stream is bounded (``[batch]``
limits, TTLs); a batch record changes only by compare-and-set (:meth:`BatchStore.update_batch`),
so the gateway (cancel) and any number of runners never lose each other's writes.

    store = await BatchStore.open(nc, cfg.batch)
    rec = await store.batch(owner, batch_id)
    rec = await store.update_batch(owner, batch_id, lambda r: cancel(r, now))
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, cast

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    ObjectMeta,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    APIError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from zmlcore import subjects
from zmlcore.batch.ids import owner_token
from zmlcore.bus import natsinternals
from zmlcore.bus.ensure import ensure, ensure_kv
from zmlcore.bus.kvfollow import live_entries
from zmlcore.bus.link import link_of
from zmlcore.config import BatchConfig, window_seconds
from zmlcore.errors import NotFoundError, StorageFullError
from zmlcore.messages.batch import (
    NULL,
    TERMINAL,
    BatchRecord,
    FileRecord,
    LineResult,
    batch_record_decoder,
    file_record_decoder,
    line_result_decoder,
)

log = logging.getLogger("zml.batch.store")
_encode = msgspec.json.encode

#: Re-splitting a batch whose first split was cut short (a runner died) publishes the same
#: shards again: JetStream drops them as duplicates within this window.
DEDUP_WINDOW_S = 15 * 60.0
#: Work on a whole batch (validating, writing the files) is renewed within this; a runner that
#: dies doing it leaves it to another this long after. Shards use ``[batch] takeover_s``.
TASK_ACK_WAIT_S = 60.0
#: Chunk size of stored files (the object store's default).
CHUNK = 128 * 1024
#: Room a result or shard message leaves for its headers and fields within max_payload.
MESSAGE_ROOM = 16 * 1024


def file_key(owner: str, file_id: str) -> str:
    return f"f.{owner_token(owner)}.{file_id}"


def batch_key(owner: str, batch_id: str) -> str:
    return f"b.{owner_token(owner)}.{batch_id}"


def _retention_s(cfg: BatchConfig) -> float:
    """How long work and results may wait: the longest completion window, and a day more for
    a batch that finishes at the end of its window to be written out."""
    return max(window_seconds(w) for w in cfg.completion_windows) + 86400.0


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    name = config.name
    assert name is not None
    await ensure(lambda: js.stream_info(name), lambda: js.add_stream(config), f"stream {name}")


async def _ensure_consumer(js: JetStreamContext, stream: str, name: str, subject: str, ack_wait: float,
                           max_ack_pending: int) -> None:
    config = ConsumerConfig(durable_name=name, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT,
                            ack_wait=ack_wait, max_deliver=-1, max_ack_pending=max_ack_pending)
    await ensure(lambda: js.consumer_info(stream, name), lambda: js.add_consumer(stream, config),
                 f"consumer {stream}/{name}")


class BatchStore:
    def __init__(self, nc: NATS, js: JetStreamContext, kv: KeyValue, files: ObjectStore, cfg: BatchConfig) -> None:
        self.nc = nc
        self.js = js
        self.kv = kv
        self.files = files
        self.cfg = cfg

    @classmethod
    async def open(cls, nc: NATS, cfg: BatchConfig, *, consumers: bool = False) -> BatchStore:
        """Open (creating on first use) the index, the file store and both streams; with
        ``consumers``, the runners' durable consumers too."""
        js = nc.jetstream()
        ttl = cfg.file_ttl_s
        kv = await ensure_kv(js, subjects.BATCH_INDEX_BUCKET, ttl=ttl, max_bytes=256 * 1024 * 1024, direct=True)
        replicas = link_of(nc).replicas
        files = await ensure(
            lambda: js.object_store(subjects.BATCH_FILES_BUCKET),
            lambda: js.create_object_store(subjects.BATCH_FILES_BUCKET, ObjectStoreConfig(
                bucket=subjects.BATCH_FILES_BUCKET, ttl=ttl, max_bytes=cfg.max_store_bytes,
                storage=StorageType.FILE, replicas=replicas)),
            f"object store {subjects.BATCH_FILES_BUCKET}")
        keep = _retention_s(cfg)
        await _ensure_stream(js, StreamConfig(
            name=subjects.BATCH_WORK_STREAM, subjects=[f"{subjects.BATCH_WORK_PREFIX}.>"],
            retention=RetentionPolicy.WORK_QUEUE, max_bytes=cfg.max_work_bytes, max_age=keep,
            discard=DiscardPolicy.NEW, duplicate_window=DEDUP_WINDOW_S, storage=StorageType.FILE,
            num_replicas=replicas))
        await _ensure_stream(js, StreamConfig(
            name=subjects.BATCH_RESULTS_STREAM, subjects=[f"{subjects.BATCH_RESULT_PREFIX}.>"],
            retention=RetentionPolicy.LIMITS, max_bytes=cfg.max_results_bytes, max_age=keep,
            # One message per line, the first one kept: a line recorded twice (a runner that
            # died after recording, before its ack) still has exactly one result.
            max_msgs_per_subject=1, discard=DiscardPolicy.NEW, discard_new_per_subject=True,
            duplicate_window=DEDUP_WINDOW_S, storage=StorageType.FILE, num_replicas=replicas))
        if consumers:
            w = subjects.BATCH_WORK_STREAM
            await _ensure_consumer(js, w, subjects.BATCH_START_CONSUMER, subjects.BATCH_WORK_START,
                                   TASK_ACK_WAIT_S, 64)
            await _ensure_consumer(js, w, subjects.BATCH_SHARD_CONSUMER, subjects.BATCH_WORK_SHARDS,
                                   cfg.takeover_s, 10_000)
            await _ensure_consumer(js, w, subjects.BATCH_FINAL_CONSUMER, subjects.BATCH_WORK_FINAL,
                                   TASK_ACK_WAIT_S, 64)
        return cls(nc, js, kv, files, cfg)

    # --- files ---------------------------------------------------------------------------------
    async def put_file(self, rec: FileRecord, data: IO[bytes] | bytes) -> FileRecord:
        """Store the bytes, then the record (a record never names missing bytes). Raises
        StorageFullError when the store is at its bound."""
        try:
            # nats-py reads any object with readinto(); its annotation says BufferedIOBase only
            await self.files.put(rec.id, cast(Any, data), meta=ObjectMeta(name=rec.id, description=rec.filename[:200]))
        except APIError as exc:
            if _store_full(exc):
                raise StorageFullError(f"the batch file store is full ([batch] max_store_bytes "
                                       f"{self.cfg.max_store_bytes} bytes): delete files or retry later",
                                       retry_after=60.0) from exc
            raise
        await self.kv.put(file_key(rec.owner, rec.id), _encode(rec))
        return rec

    async def file(self, owner: str, file_id: str) -> FileRecord:
        try:
            entry = await self.kv.get(file_key(owner, file_id))
        except KeyNotFoundError:
            raise NotFoundError(f"no file {file_id!r}") from None
        if not entry.value:
            raise NotFoundError(f"no file {file_id!r}")
        return file_record_decoder.decode(entry.value)

    async def list_files(self, owner: str) -> list[FileRecord]:
        return [file_record_decoder.decode(v) for v in await self._values(f"f.{owner_token(owner)}.*")]

    async def delete_file(self, owner: str, file_id: str) -> None:
        await self.file(owner, file_id)  # NotFoundError for anyone else's
        await self.kv.delete(file_key(owner, file_id))
        try:
            await self.files.delete(file_id)
        except ObjectNotFoundError:
            pass

    async def read_file(self, file_id: str, timeout: float = 10.0) -> AsyncIterator[bytes]:
        """The stored bytes in chunks, without holding the whole file (checked against the
        object's SHA-256 at the end). The object store's chunks are read directly: one ordered
        consumer on the object's chunk subject (the NATS object store layout, ADR-20)."""
        try:
            info = await self.files.get_info(file_id)
        except ObjectNotFoundError:
            raise NotFoundError(f"the bytes of file {file_id!r} are gone (expired)") from None
        if not info.size:
            return
        sub = await self.js.subscribe(f"$O.{subjects.BATCH_FILES_BUCKET}.C.{info.nuid}",
                                      stream=f"OBJ_{subjects.BATCH_FILES_BUCKET}", ordered_consumer=True,
                                      inactive_threshold=30.0)
        digest = hashlib.sha256()
        try:
            while True:
                msg = await sub.next_msg(timeout=timeout)
                digest.update(msg.data)
                yield msg.data
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await self._drop(sub)
        want = (info.digest or "").split("=", 1)[-1]
        if want and base64.urlsafe_b64decode(want + "=" * (-len(want) % 4)) != digest.digest():
            raise OSError(f"file {file_id}: stored bytes do not match their digest")

    # --- batches -------------------------------------------------------------------------------
    async def create_batch(self, rec: BatchRecord) -> BatchRecord:
        await self.kv.create(batch_key(rec.owner, rec.id), _encode(rec))
        return rec

    async def batch(self, owner: str, batch_id: str) -> BatchRecord:
        return (await self._batch_entry(owner, batch_id))[0]

    async def _batch_entry(self, owner: str, batch_id: str) -> tuple[BatchRecord, int]:
        try:
            entry = await self.kv.get(batch_key(owner, batch_id))
        except KeyNotFoundError:
            raise NotFoundError(f"no batch {batch_id!r}") from None
        if not entry.value or entry.revision is None:
            raise NotFoundError(f"no batch {batch_id!r}")
        return batch_record_decoder.decode(entry.value), entry.revision

    async def list_batches(self, owner: str) -> list[BatchRecord]:
        return [batch_record_decoder.decode(v) for v in await self._values(f"b.{owner_token(owner)}.*")]

    async def all_batches(self) -> list[BatchRecord]:
        """Every owner's batches (the operator's view: the dashboard)."""
        return [batch_record_decoder.decode(v) for v in await self._values("b.*.*")]

    async def active_batches(self, owner: str) -> int:
        return sum(1 for b in await self.list_batches(owner) if b.status not in TERMINAL)

    async def update_batch(self, owner: str, batch_id: str,
                           change: Callable[[BatchRecord], BatchRecord | None]) -> BatchRecord:
        """Read, change, compare-and-set, until it sticks. ``change`` gets a copy and returns the
        new record, or None to leave it as it is (the current record is returned)."""
        key = batch_key(owner, batch_id)
        for attempt in range(100):
            rec, revision = await self._batch_entry(owner, batch_id)
            new = change(rec)
            if new is None:
                return rec
            try:
                await self.kv.update(key, _encode(new), last=revision)
                return new
            except KeyWrongLastSequenceError:
                await asyncio.sleep(0.001 * attempt)
        raise RuntimeError(f"batch {batch_id}: record too contended to update")

    # --- line results --------------------------------------------------------------------------
    async def record(self, batch_id: str, shard: int, result: LineResult) -> bool:
        """Store one line's result durably, at most once per line (the stream keeps the first
        and refuses later ones): True if this one was stored, False if the line already had
        one. A reply too large for one message goes to the file store, the result points to it."""
        subject = subjects.batch_result(batch_id, shard, result.line)
        payload = _encode(result)
        limit = (self.nc.max_payload or 1024 * 1024) - MESSAGE_ROOM
        if len(payload) > limit:
            name = spill_name(batch_id, result.line)
            await self.files.put(name, bytes(result.body), meta=ObjectMeta(name=name))
            payload = _encode(msgspec.structs.replace(result, body=NULL, spilled=name))
        try:
            return await self.publish(subject, payload, f"{batch_id}:{result.line}")
        except APIError as exc:
            if _per_subject_full(exc):
                return False
            raise

    async def results(self, batch_id: str, shard: int | None = None, timeout: float = 10.0) -> AsyncIterator[LineResult]:
        """A batch's (or one shard's) stored results, in the order they were stored, each with
        its reply put back if it was spilled to the file store."""
        sub = await self.js.subscribe(subjects.batch_results(batch_id, shard), stream=subjects.BATCH_RESULTS_STREAM,
                                      ordered_consumer=True, inactive_threshold=30.0)
        try:
            # Messages are pushed as soon as the consumer exists: some may be on their way already.
            info = await sub.consumer_info()
            left = (info.num_pending or 0) + ((info.delivered.consumer_seq or 0) if info.delivered else 0)
            while left:
                msg = await sub.next_msg(timeout=timeout)
                result = line_result_decoder.decode(msg.data)
                if result.spilled:
                    data = b"".join([c async for c in self.read_file(result.spilled)]) or b"null"
                    result = msgspec.structs.replace(result, body=msgspec.Raw(data))
                yield result
                left = msg.metadata.num_pending
        finally:
            await self._drop(sub)

    async def _drop(self, sub: Any) -> None:
        """End a one-off read: unsubscribe and delete its consumer, which the server would
        otherwise keep for its inactive threshold (and refuse new ones past its limit: a client
        downloading a file 1,000 times in 30 s, a runner re-reading results)."""
        consumer = natsinternals.sub_consumer(sub)
        try:
            await sub.unsubscribe()
            if consumer is not None:
                await self.js.delete_consumer(*consumer)
        except Exception:  # gone already, or no connection: its inactive threshold removes it
            pass

    async def drop_results(self, batch_id: str, spilled: list[str]) -> None:
        """A batch written out: its results (and spilled replies) are no longer needed."""
        await self.js.purge_stream(subjects.BATCH_RESULTS_STREAM, subject=subjects.batch_results(batch_id))
        for name in spilled:
            try:
                await self.files.delete(name)
            except ObjectNotFoundError:
                pass

    # --- work ----------------------------------------------------------------------------------
    async def publish(self, subject: str, payload: bytes, msg_id: str) -> bool:
        """Put one message in a stream, once (JetStream drops a repeat of ``msg_id`` within the
        dedup window); True if it was new."""
        ack = await self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
        return not ack.duplicate

    async def _values(self, pattern: str) -> list[bytes]:
        """The current values of the keys matching ``pattern`` (one snapshot, see
        :func:`~zmlcore.bus.kvfollow.live_entries` for why not nats-py's bare watch)."""
        return [v for v in (await live_entries(self.kv, self.nc, pattern)).values() if v]


def spill_name(batch_id: str, line: int) -> str:
    """File store name of a line's reply too large for the results stream."""
    return f"spill.{batch_id}.{line}"


def _per_subject_full(exc: APIError) -> bool:
    text = f"{getattr(exc, 'description', '')}".lower()
    return "per subject" in text or getattr(exc, "err_code", 0) == 10077


def _store_full(exc: APIError) -> bool:
    text = f"{getattr(exc, 'description', '')} {getattr(exc, 'err_code', '')}".lower()
    return "maximum bytes" in text or "insufficient resources" in text or "10047" in text
