"""Session bindings shared by every router replica: a conversation's requests stay on one node
while that node is within its load bound (the pure rule: ``zmlcore.policy.session``).

A session is named by the caller: ``Zml-Session`` on NATS (``x-session-id`` over HTTP, the SDK's
``session=``), else the OpenAI ``user`` field. Its binding lives in the KV bucket
``zml_sessions`` (memory storage) under a hash of (owner, session): one caller's session names
never meet another's. The bucket's TTL is ``[router] session_idle_s``: a session idle that long
is forgotten. Every replica follows the bucket, so the next request of a conversation finds its
node whichever replica gets it; a binding is written when it changes, and rewritten at most
every quarter of the idle time while the conversation goes on (it must not expire mid-way; one
write per request would cost a JetStream round trip each). An entry the bucket's TTL removes
sends no notice to watchers, so each replica also forgets a binding it has not seen written for
the idle time (the same clock: it sees every rewrite).

    sessions = Sessions(nc, idle_s=600)
    await sessions.start()
    key = session_key(owner, "conv-42")
    node = sessions.node(key)           # None: unbound
    sessions.bind(key, "h100-1", now)   # after dispatching
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.bus.ensure import ensure_kv
from zmlcore.bus.kvfollow import KVFollower

log = logging.getLogger("zml.router.sessions")


def session_key(owner: str, session: str) -> str:
    """The bucket key of ``owner``'s session ``session`` (KV keys allow few characters)."""
    return hashlib.blake2b(f"{owner}\x00{session}".encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class Sessions:
    def __init__(self, nc: NATS, *, idle_s: float, clock: Callable[[], float] = time.time) -> None:
        self.nc = nc
        self.idle_s = idle_s
        self.clock = clock
        #: session key -> (node id, when this replica last saw it written), as the bucket says
        self.bound: dict[str, tuple[str, float]] = {}
        self._written: dict[str, float] = {}
        self._sweep_at = 0.0
        self.kv: KeyValue | None = None
        self._follower: KVFollower | None = None
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Open the bucket and follow it, in the background: bindings are soft state, and a
        router must take traffic even while JetStream is slow or away (sessions then start
        unbound and are bound once it answers)."""
        self._task = asyncio.create_task(self._run(), name="sessions-follow")

    async def _run(self) -> None:
        delay = 0.1
        while self.kv is None:
            try:
                # Created with its TTL before the follower opens it (it would create it without).
                self.kv = await ensure_kv(self.nc.jetstream(), subjects.SESSIONS_BUCKET, ttl=self.idle_s,
                                          memory=True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("session bucket not ready (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self._follower = KVFollower(self.nc, subjects.SESSIONS_BUCKET, on_put=self._put, on_delete=self._delete)
        await self._follower.run()

    async def wait_ready(self, timeout: float) -> bool:
        """Until the bucket's snapshot is read (tests); False after ``timeout``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._follower is None:
            if loop.time() >= end:
                return False
            await asyncio.sleep(0.02)
        return await self._follower.wait_ready(max(0.0, end - loop.time()))

    async def stop(self) -> None:
        for task in [*self._writes, *([self._task] if self._task else [])]:
            task.cancel()
        await asyncio.gather(*self._writes, *([self._task] if self._task else []), return_exceptions=True)

    def _put(self, key: str, value: bytes) -> None:
        self.bound[key] = (value.decode(), self.clock())

    def _delete(self, key: str) -> None:
        self.bound.pop(key, None)
        self._written.pop(key, None)

    def node(self, key: str, now: float | None = None) -> str | None:
        entry = self.bound.get(key)
        if entry is None:
            return None
        now = self.clock() if now is None else now
        if now - entry[1] >= self.idle_s:
            self._delete(key)
            return None
        return entry[0]

    def _sweep(self, now: float) -> None:
        """Forget the bindings idle for good (bounded memory with many short sessions)."""
        if now < self._sweep_at:
            return
        self._sweep_at = now + self.idle_s / 4
        for key in [k for k, (_, seen) in self.bound.items() if now - seen >= self.idle_s]:
            self._delete(key)

    def bind(self, key: str, node_id: str, now: float | None = None) -> None:
        """The session's request went to ``node_id``: write the binding if it changed or is due."""
        now = self.clock() if now is None else now
        entry = self.bound.get(key)
        if entry is not None and entry[0] == node_id and now - self._written.get(key, -1e18) < self.idle_s / 4:
            return
        self.bound[key] = (node_id, now)
        self._written[key] = now
        self._sweep(now)
        task = asyncio.ensure_future(self._write(key, node_id))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, key: str, node_id: str) -> None:
        if self.kv is None:
            return
        try:
            await self.kv.put(key, node_id.encode())
        except Exception as exc:  # a lost write only costs affinity for one request
            log.debug("session binding not written: %s", exc)
            self._written.pop(key, None)
