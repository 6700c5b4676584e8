"""Plan limits shared by every gateway replica: one KV entry per limited identity, updated
with compare-and-set (JetStream's "expected last subject sequence").

Each admission reads the entry, applies :func:`zmlcore.plans.admit` and writes it back only if
nobody wrote in between; a lost race re-reads and re-decides. Two gateways behind one key
therefore admit the plan's rate together, not twice it. A release (lease freed, tokens counted)
does the same off the response path. Entries expire from the bucket when idle (max_age).

Cost: two JetStream round trips on the admission path (get + update), measured in
docs/benchmarks.md. If JetStream cannot be reached the limiter fails open (logs a warning): an
outage of the limit store must not take inference down with it.

    limiter = await SharedLimiter.open(nc)
    verdict = await limiter.acquire("key-id", PLANS["team"], lease_id=request_id, lease_s=60)
    ...
    limiter.release_soon("key-id", lease_id=request_id, tokens=123)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.messages.keys import LimitState, PlanLimits, limit_state_decoder
from zmlcore.plans import WINDOW_S, Verdict, admit, release

log = logging.getLogger("zml.limiter")

#: Compare-and-set attempts before a contended admission is refused (429, retry in 1 s).
MAX_TRIES = 32
_encode = msgspec.json.encode


def limit_key(identity: str) -> str:
    """A KV key from an identity (key id, client address): KV keys allow ``[-/_=.a-zA-Z0-9]``."""
    return "".join(c if c.isalnum() and c.isascii() or c in "-_=" else "_" for c in identity)[:200]


class SharedLimiter:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._tasks: set[asyncio.Task[None]] = set()
        # One read-decide-write per key at a time in this replica: concurrent requests on one key
        # otherwise race each other's compare-and-set and retry in storms (measured: 115 of 1,000
        # requests refused as contended at C=32 on one key). Only other replicas can race now.
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            if len(self._locks) > 10_000:  # forget idle keys' locks
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[key] = asyncio.Lock()
        return lock

    @classmethod
    async def open(cls, nc: NATS) -> SharedLimiter:
        js = nc.jetstream()
        try:
            kv = await js.key_value(subjects.LIMITS_BUCKET)
        except (BucketNotFoundError, NotFoundError):
            try:  # two windows of history is all a sliding estimate needs
                kv = await js.create_key_value(KeyValueConfig(bucket=subjects.LIMITS_BUCKET, history=1,
                                                              ttl=3 * WINDOW_S, direct=True))
            except Exception:
                kv = await js.key_value(subjects.LIMITS_BUCKET)
        return cls(kv)

    async def _read(self, key: str) -> tuple[LimitState, int | None]:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return LimitState(), None
        if not entry.value:
            return LimitState(), None
        try:
            return limit_state_decoder.decode(entry.value), entry.revision
        except msgspec.DecodeError:
            return LimitState(), entry.revision

    async def _write(self, key: str, state: LimitState, revision: int | None) -> bool:
        try:
            if revision is None:
                await self.kv.create(key, _encode(state))
            else:
                await self.kv.update(key, _encode(state), last=revision)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def acquire(self, identity: str, limits: PlanLimits, *, lease_id: str, lease_s: float) -> Verdict:
        key = limit_key(identity)
        try:
            async with self._lock(key):
                for attempt in range(MAX_TRIES):
                    state, revision = await self._read(key)
                    new, verdict = admit(state, limits, now=time.time(), lease_id=lease_id, lease_s=lease_s)
                    if new is None or await self._write(key, new, revision):
                        return verdict
                    await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the limit store is down: fail open, loudly
            log.warning("plan limits not enforced for %s: %s: %s", key, type(exc).__name__, exc)
            return Verdict(True, requests_limit=limits.requests_per_minute, tokens_limit=limits.tokens_per_minute)
        return Verdict(False, "contended", 1.0, requests_limit=limits.requests_per_minute,
                       tokens_limit=limits.tokens_per_minute)

    async def release(self, identity: str, *, lease_id: str, tokens: int) -> None:
        key = limit_key(identity)
        try:
            async with self._lock(key):
                for _ in range(MAX_TRIES):
                    state, revision = await self._read(key)
                    if await self._write(key, release(state, now=time.time(), lease_id=lease_id, tokens=tokens),
                                         revision):
                        return
                    await asyncio.sleep(random.uniform(0, 0.005))
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the lease expires on its own
            log.warning("release for %s not recorded: %s", key, exc)

    def release_soon(self, identity: str, *, lease_id: str, tokens: int) -> None:
        """Release off the response path (the caller has its answer already)."""
        task = asyncio.ensure_future(self.release(identity, lease_id=lease_id, tokens=tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
