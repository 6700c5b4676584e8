"""One active replica among several (health, warmup): a leader lease in the KV bucket
``zml_leases``, one key per role, kept with JetStream's compare-and-set.

- Acquire: ``create`` the key (succeeds only if it is absent or deleted).
- Hold: every ``ttl/3`` seconds ``update`` it with the revision we last wrote. A wrong-revision
  answer means another replica took over: we have lost it.
- Take over: a standby reads the key every ``ttl/8`` seconds; if its revision has not changed for
  ``ttl`` seconds *as measured by the standby's own clock* (no clock skew between machines
  matters), the holder is gone, and the standby ``update``s it with the revision it saw: of
  several standbys exactly one wins. A standby that cannot read the key (broker away) restarts
  its count, so a broker outage alone never moves the lease.
- Release: a holder that stops cleanly deletes the key (with its revision), so a standby takes
  over at once instead of after ``ttl``.

    lease = Lease(nc, "health", ttl_s=cfg.health.poll_interval_s)
    await lease.acquire()          # returns once this replica is the active one
    await lease.hold()             # returns when the lease is lost
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.bus.ensure import ensure_kv

log = logging.getLogger("zml.lease")

#: Entries of dead holders are dropped after this long (the lease itself never relies on it).
BUCKET_MAX_AGE_S = 24 * 3600.0


#: Shortest lease: a busy machine may stall an event loop for a few hundred ms, and a lease
#: that lapses on a stall fails over needlessly.
MIN_TTL_S = 2.0


def lease_ttl_s(interval_s: float) -> float:
    """The lease TTL for a service that works every ``interval_s`` (a health poll, a warmup
    sweep): one interval (at least MIN_TTL_S), so a standby takes over within about
    ``ttl + ttl/4`` of the active one's last renewal (it sees each renewal up to ttl/8 late and
    checks every ttl/8): under two intervals."""
    return max(MIN_TTL_S, interval_s)


def holder_id(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class Lease:
    def __init__(self, nc: NATS, role: str, *, ttl_s: float, holder: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self.role = role
        self.ttl = ttl_s
        self.holder = holder or holder_id(role)
        self._clock = clock
        self._kv: KeyValue | None = None
        #: Revision of our last write while we hold the lease.
        self.revision: int | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            js = self.nc.jetstream(timeout=max(0.5, self.ttl / 2))
            self._kv = await ensure_kv(js, subjects.LEASES_BUCKET, ttl=BUCKET_MAX_AGE_S,
                                       wait_s=0)  # acquire's loop retries, on the lease's clock
        return self._kv

    async def acquire(self) -> None:
        """Wait until this replica holds the lease."""
        seen_rev: int | None = None
        seen_at = self._clock()
        announced = False
        while True:
            try:
                kv = await self._bucket()
                try:
                    self.revision = await kv.create(self.role, self.holder.encode())
                    log.info("%s: active (lease acquired)", self.holder)
                    return
                except KeyWrongLastSequenceError:
                    pass
                entry = await kv.get(self.role)
                now = self._clock()
                if entry.revision != seen_rev:
                    seen_rev, seen_at = entry.revision, now
                    if not announced:
                        log.info("%s: standby (active: %s)", self.holder, (entry.value or b"").decode())
                        announced = True
                elif now - seen_at >= self.ttl:
                    try:
                        self.revision = await kv.update(self.role, self.holder.encode(), last=entry.revision)
                        log.warning("%s: active (took over from %s, silent %.2f s)", self.holder,
                                    (entry.value or b"").decode(), now - seen_at)
                        return
                    except KeyWrongLastSequenceError:
                        seen_rev = None  # another standby was quicker
            except asyncio.CancelledError:
                raise
            except KeyNotFoundError:
                continue  # deleted between create and get: create again at once
            except Exception as exc:  # broker away: we cannot judge the holder, count again
                log.debug("lease %s: %s", self.role, exc)
                seen_rev = None
            await asyncio.sleep(self.ttl / 8)

    async def hold(self) -> None:
        """Renew until the lease is lost (another replica holds it); then return."""
        assert self.revision is not None
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                kv = await self._bucket()
                self.revision = await kv.update(self.role, self.holder.encode(), last=self.revision)
            except asyncio.CancelledError:
                raise
            except KeyWrongLastSequenceError:
                if await self._still_ours(kv):
                    continue
                log.warning("%s: lease lost to another replica", self.holder)
                self.revision = None
                return
            except Exception as exc:  # broker away: keep going; a standby cannot take over either
                log.debug("lease %s renewal failed: %s", self.role, exc)

    async def _still_ours(self, kv: KeyValue) -> bool:
        """After a wrong-revision answer: is the key's holder still this replica? A renewal that
        timed out while the broker was away can still land later (the client sends what it
        buffered on reconnect), moving the revision under us; the holder id is this process's
        own, so a key holding it was written by us: adopt its revision and keep the lease."""
        try:
            entry = await kv.get(self.role)
        except Exception as exc:  # cannot tell now: try again at the next renewal
            log.debug("lease %s: reading it back failed: %s", self.role, exc)
            return True
        if (entry.value or b"").decode() == self.holder:
            log.info("%s: a renewal sent before the broker blinked landed late; lease kept (revision %s)",
                     self.holder, entry.revision)
            self.revision = entry.revision
            return True
        return False

    async def release(self) -> None:
        """Hand over now (clean stop): delete our key if it is still ours."""
        if self.revision is None:
            return
        try:
            kv = await self._bucket()
            await kv.delete(self.role, last=self.revision)
        except Exception:  # not ours any more, or broker away: the TTL does it
            pass
        self.revision = None
