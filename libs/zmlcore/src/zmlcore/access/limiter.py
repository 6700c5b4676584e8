"""Plan limits shared by every gateway and router replica: one KV entry per limited identity,
updated with compare-and-set (JetStream's "expected last subject sequence").

A replica does not write the entry for every request: it leases several requests and holds
concurrency slots at once and spends them locally (:mod:`zmlcore.access.shares`, the pure half: sizes,
slack and what the headers mean). A round trip happens when a lease runs out or ends (about one
per second per replica on a hot key, always one per request near the limit), and a background
sweep gives back what a lease left unspent, renews held slots and adds the tokens counted here.
Two gateways behind one key therefore admit the plan's rate together, not twice it. A lost
compare-and-set race re-reads and re-decides. Entries expire from the bucket when idle (max_age).

If JetStream cannot be reached the limiter fails open (logs a warning): an outage of the limit
store must not take inference down with it.

    limiter = await SharedLimiter.open(nc)
    verdict = await limiter.acquire("key-id", PLANS["team"], lease_id=request_id, lease_s=60)
    ...
    await limiter.release("key-id", lease_id=request_id, tokens=123)   # before the reply goes out
    await limiter.close()   # gives back unspent leases and held slots
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.access.shares import LEASE_S, Book
from zmlcore.messages.keys import LimitState, PlanLimits, limit_state_decoder
from zmlcore.access.plans import WINDOW_S, Verdict, refusal_of, roll
from zmlcore.bus.cancel import cancel_and_wait
from zmlcore.bus.ensure import ensure_kv

log = logging.getLogger("zml.limiter")

#: Compare-and-set attempts before a contended admission is refused (429, retry in 1 s).
MAX_TRIES = 32
#: Longest a release waits for the shared entry to hear of it (a slow limit store delays a
#: reply by at most this; the write carries on in the background).
RELEASE_WAIT_S = 0.5
_encode = msgspec.json.encode


def limit_key(identity: str) -> str:
    """A KV key from an identity (key id, client address): KV keys allow ``[-/_=.a-zA-Z0-9]``."""
    return "".join(c if c.isalnum() and c.isascii() or c in "-_=" else "_" for c in identity)[:200]


class SharedLimiter:
    def __init__(self, kv: KeyValue, holder: str = "") -> None:
        self.kv = kv
        #: This replica's name in the entries' holds (unique per process and limiter).
        self.holder = holder or f"{os.getpid()}-{os.urandom(4).hex()}"
        self.books: dict[str, Book] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        # One read-decide-write per key at a time in this replica: concurrent requests whose lease
        # ran out wait for one refill instead of racing each other's compare-and-set.
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
        # Entries outlive a sliding estimate's two windows by one; any replica may serve reads.
        return cls(await ensure_kv(nc.jetstream(), subjects.LIMITS_BUCKET, ttl=3 * WINDOW_S, direct=True))

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

    async def _settle(self, key: str, book: Book, limits: PlanLimits, *, take: bool, lease_id: str = "",
                      lease_s: float = 0.0, closing: bool = False) -> Verdict | None:
        """Read, merge the book (:meth:`Book.settle`), compare-and-set; under the key's lock."""
        book.writing = True
        try:
            for attempt in range(MAX_TRIES):
                state, revision = await self._read(key)
                now = time.time()
                st = book.settle(state, limits, now=now, holder=self.holder, take=take, lease_id=lease_id,
                                 lease_s=lease_s, closing=closing)
                if st.state is None or await self._write(key, st.state, revision):
                    book.commit(st, limits, now=now, lease_id=lease_id, lease_s=lease_s)
                    return st.verdict
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        finally:
            book.writing = False
        if not take:
            return None
        return Verdict(False, "contended", 1.0, requests_limit=limits.requests_per_minute,
                       tokens_limit=limits.tokens_per_minute)

    async def acquire(self, identity: str, limits: PlanLimits, *, lease_id: str, lease_s: float) -> Verdict:
        """Admit one request of ``identity`` (free it with :meth:`release`)."""
        key = limit_key(identity)
        book = self._book(key, limits)
        verdict = book.spend(limits, now=time.time(), lease_id=lease_id, lease_s=lease_s)
        if verdict is not None:  # the hot path: no round trip
            return verdict
        try:
            # Shielded: a caller cancelled between the write and its commit would leave the book
            # believing in a lease the entry no longer has.
            return await asyncio.shield(self._refill(key, book, limits, lease_id, lease_s))
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the limit store is down: fail open, loudly
            log.warning("plan limits not enforced for %s: %s: %s", key, type(exc).__name__, exc)
            return Verdict(True, requests_limit=limits.requests_per_minute, tokens_limit=limits.tokens_per_minute)

    async def _refill(self, key: str, book: Book, limits: PlanLimits, lease_id: str, lease_s: float) -> Verdict:
        async with self._lock(key):
            verdict = book.spend(limits, now=time.time(), lease_id=lease_id, lease_s=lease_s)
            if verdict is None:  # nobody refilled the lease while we waited: refill it
                verdict = await self._settle(key, book, limits, take=True, lease_id=lease_id, lease_s=lease_s)
            assert verdict is not None
            return verdict

    async def _flush(self, key: str, *, closing: bool = False, urgent_only: bool = False) -> None:
        book = self.books.get(key)
        if book is None:
            return
        try:
            async with self._lock(key):
                if urgent_only and not book.urgent(time.time()):
                    return
                await self._settle(key, book, book.limits, take=False, closing=closing)
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the lease and holds expire on their own
            log.warning("limits of %s not written: %s: %s", key, type(exc).__name__, exc)

    async def release(self, identity: str, *, lease_id: str, tokens: int) -> None:
        """The request ended: free its slot and count its tokens. When the shared entry must
        hear of it now (slots short, tokens nearly used: :meth:`Book.urgent`), this returns once
        it has (bounded by RELEASE_WAIT_S). Called before the request's last reply goes out, so
        a client that sends its next request on that reply finds its slot free on every
        replica: a sequential client never meets its own concurrency limit."""
        key = limit_key(identity)
        book = self.books.get(key)
        if book is None:
            return
        # A write in flight (another request's refill, the sweep) counted this request as busy:
        # after it, this release may still have to be written.
        if book.done(lease_id, tokens=tokens, now=time.time()) or book.writing:
            task = self._flush_soon(key)
            await asyncio.wait({task}, timeout=RELEASE_WAIT_S)  # never cancelled half-written

    async def add_tokens(self, identity: str, limits: PlanLimits, tokens: int) -> None:
        """Count tokens used outside any admitted request (a batch line's, run by a batch runner
        for the key that owns the batch) against ``identity``'s plan: written with the book's
        next write, at once when the plan is near its token limit."""
        if tokens <= 0:
            return
        key = limit_key(identity)
        if self._book(key, limits).done("", tokens=tokens, now=time.time()):
            self._flush_soon(key)

    def _book(self, key: str, limits: PlanLimits) -> Book:
        book = self.books.get(key)
        if book is None:
            book = self.books[key] = Book(limits)
            if self._sweeper is None:
                self._sweeper = asyncio.create_task(self._sweep())
        return book

    def _flush_soon(self, key: str) -> asyncio.Future[None]:
        """Write the key's book now if it is urgent, in the background (never cancelled half-written)."""
        task = asyncio.ensure_future(self._flush(key, urgent_only=True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def tokens_wait(self, identity: str, limits: PlanLimits) -> float:
        """Seconds until ``identity``'s plan has tokens left this minute (0: now; always 0 for a
        plan without tokens_per_minute). One read of the shared entry."""
        tpm = limits.tokens_per_minute
        if tpm is None:
            return 0.0
        key = limit_key(identity)
        state, _ = await self._read(key)
        now = time.time()
        state = roll(state, now)
        book = self.books.get(key)
        if book is not None:  # counted here, not written yet
            state.tokens += book.tokens
        verdict = refusal_of(state, PlanLimits(tokens_per_minute=tpm), now=now, busy=0)
        return verdict.retry_after_s if verdict is not None else 0.0

    async def _sweep(self) -> None:
        """Give back ended leases, renew or give back holds, write pending tokens; forget idle books."""
        while True:
            await asyncio.sleep(LEASE_S / 2)
            now = time.time()
            for key, book in list(self.books.items()):
                if book.due(now):
                    await self._flush(key)
                elif book.idle():
                    del self.books[key]

    async def close(self) -> None:
        """Give back every unspent lease and held slot (bounded: at most 2 s)."""
        if self._sweeper is not None:
            await cancel_and_wait([self._sweeper])
            self._sweeper = None
        keys = [k for k, b in self.books.items() if not b.idle()]
        tasks = [*self._tasks, *(asyncio.ensure_future(self._flush(k, closing=True)) for k in keys)]
        if tasks:
            await asyncio.wait(tasks, timeout=2)
