"""Follow a KV bucket for as long as the service runs: a snapshot, then every update and delete,
surviving broker restarts, the loss of a cluster server and stalled watches.

nats-py's KV watch is an ordered consumer: the server holds it in memory, so it dies with the
broker (or with the cluster server that held it). nats-py only notices after two missed idle
heartbeats (~10 s) and resumes at the next stream sequence, which after a broker that lost its
state may not exist. Here the watch is re-created, with a fresh snapshot, as soon as the
connection comes back, or when a periodic check finds its consumer gone. A key missing from the
new snapshot was deleted meanwhile and is reported as deleted: at once, or after
``keep_vanished(key)`` seconds for a follower that would rather let it age out (the router's
node table, where a state older than ``stale_after_s`` is stale anyway). A delete or purge seen
as such (the bucket keeps its marker) is always reported at once.

The end of a snapshot: nats-py's watch emits its "nothing pending" marker (``None``) before any
entry when the server has already sent the snapshot but the client has not read it yet (it asks
``consumer_info`` after subscribing: ``num_pending`` 0, its own delivered count still 0; ~1
watch in 300-1,000 on a busy box, nats-io/nats.py#842). Taken at its word, that read as an
empty bucket: a re-watch after a broker restart reported every key deleted for a few
milliseconds, and the router answered MODEL_NOT_LOADED. So a marker that comes before any entry
is checked with the server (:func:`snapshot_empty`); otherwise the snapshot ends with the entry
whose ``delta`` (pending count) is 0.

Every watch's consumer is created with a short ``inactive_threshold`` (:data:`WATCH_INACTIVE_S`)
and a re-created watch deletes the consumer it replaces. nats-py's default keeps a consumer
nobody listens to for 5 minutes, and nats-py itself replaces an ordered consumer whenever it
sees a sequence gap or misses heartbeats (a CPU-starved client), leaving the old one behind:
under load, orphans piled up on the server (9 consumers on ``zml_nodes`` for 6 live watches).

    follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=table.put_raw, on_delete=table.remove)
    task = asyncio.create_task(follower.run())
    await follower.wait_ready(2.0)

A watch delivers a moment after the write (milliseconds; more on a loaded box). A caller about to
refuse on a key it does not have yet (the router, for a request pinned to a node registered just
now) asks :meth:`KVFollower.refresh` to read that key directly first.

Every KV reader in ZML goes through here: :class:`KVFollower` for the services' followers
(router, gateway, warmup, keys, costs) and ``zml serve --wait``, :func:`live_entries` for a one-off
listing (health at start, the batch store's lists, ``zml keys list``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from zmlcore.bus import natsinternals
from zmlcore.bus.link import link_of
from zmlcore.bus.ensure import ensure_kv

log = logging.getLogger("zml.kvfollow")

_DELETE_OPS = ("DEL", "PURGE")

#: Seconds the server keeps a watch's consumer once nothing listens to it. A live watch always
#: listens; a client that reconnects later re-creates its watches anyway (see above).
WATCH_INACTIVE_S = 10.0

#: Longer keys are not read (the requests naming them are someone else's input).
_MAX_KEY = 256


async def watch_bucket(kv: KeyValue, pattern: str = ">", *, inactive_s: float = WATCH_INACTIVE_S,
                       **kwargs: Any) -> KeyValue.KeyWatcher:
    """``kv.watch(pattern, **kwargs)`` whose consumer the server drops ``inactive_s`` after its
    watcher stops or is replaced (every KV watch in ZML goes through here)."""
    return await kv.watch(pattern, inactive_threshold=inactive_s, **kwargs)


async def drop_watch(watcher: KeyValue.KeyWatcher, nc: NATS) -> None:
    """Stop a watcher (of a bucket opened on ``nc``) and delete its consumer (best effort, in the
    background: a re-watch after a broker restart must not wait on JetStream; without a
    connection the server drops the consumer after its inactive threshold anyway)."""
    consumer = natsinternals.watch_consumer(watcher)
    try:
        await watcher.stop()  # type: ignore[no-untyped-call]
    except Exception:  # connection gone: nothing to unsubscribe
        return
    if consumer is None or not nc.is_connected:
        return
    task = asyncio.ensure_future(_delete_consumer(nc.jetstream(), *consumer))
    _deleting.add(task)
    task.add_done_callback(_deleting.discard)


_deleting: set[asyncio.Future[None]] = set()


async def _delete_consumer(js: JetStreamContext, stream: str, consumer: str) -> None:
    try:
        await asyncio.wait_for(js.delete_consumer(stream, consumer), 2.0)
    except Exception:  # gone already (inactive, or the broker restarted), or no answer in time
        pass


async def live_keys(kv: KeyValue, nc: NATS, timeout: float = 5.0) -> list[str]:
    """The live keys of ``kv`` (a bucket opened on ``nc``), once (a snapshot read through the
    same watch as a follower). Not ``kv.keys()``: with ignore_deletes it never ends when the
    bucket's last entries are deletes (the end-of-snapshot marker rides on the skipped delete),
    and it takes nats-py's early marker for an empty bucket."""
    return list(await live_entries(kv, nc, timeout=timeout, meta_only=True))


async def live_entries(kv: KeyValue, nc: NATS, pattern: str = ">", *, timeout: float = 5.0,
                       meta_only: bool = False) -> dict[str, bytes]:
    """The live keys of ``kv`` matching ``pattern`` with their values (empty with
    ``meta_only``), once, in stream order. On a timeout, what arrived so far (logged)."""
    natsinternals.check()
    js = nc.jetstream()
    watcher = await watch_bucket(kv, pattern, meta_only=meta_only)
    live: dict[str, bytes] = {}
    got = False  # any entry yet (nats-py's early marker comes before all of them)
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=timeout)  # type: ignore[no-untyped-call]
            except Exception:  # nats TimeoutError: keep what we have
                consumer = natsinternals.watch_consumer(watcher)
                log.warning("listing the keys of %s timed out", consumer[0] if consumer else "a bucket")
                break
            if entry is None:
                if got or await snapshot_empty(watcher, js, timeout):
                    break
                continue  # the snapshot is on its way (its last entry ends it), or no answer
            got = True
            if entry.operation in _DELETE_OPS:
                live.pop(entry.key, None)
            else:
                live[entry.key] = entry.value or b""
            if entry.delta == 0:
                break
    finally:
        await drop_watch(watcher, nc)
    return live


async def snapshot_empty(watcher: KeyValue.KeyWatcher, js: JetStreamContext, timeout: float) -> bool | None:
    """Whether a new watch's snapshot really is empty, from its consumer on the server: nothing
    delivered and nothing pending (None: no answer). Asked when nats-py's end-of-snapshot marker
    comes before any entry, which it also does while the snapshot is still on the wire."""
    consumer = natsinternals.watch_consumer(watcher)
    if consumer is None:
        return None
    try:
        info = await js.consumer_info(*consumer, timeout=timeout)
    except asyncio.CancelledError:
        raise
    except Exception:
        return None
    return not info.delivered.consumer_seq and not info.num_pending


class KVFollower:
    """Calls ``on_put(key, value)`` and ``on_delete(key)`` for the live contents of ``bucket``.

    ``check_s``: how often the watch's consumer is checked while no reconnect is seen (a cluster
    server that held it died, or the watch stalled); at most one JetStream API call each time.
    ``keep_vanished(key)``: seconds to keep a key that a re-watch's snapshot no longer has (and
    no delete marker either) before reporting it deleted; None or <= 0: at once, as a bucket
    whose deletes must take effect promptly (API keys) wants.
    """

    def __init__(self, nc: NATS, bucket: str, *, on_put: Callable[[str, bytes], None],
                 on_delete: Callable[[str], None], on_synced: Callable[[], None] | None = None,
                 check_s: float = 1.0, inactive_s: float = WATCH_INACTIVE_S,
                 keep_vanished: Callable[[str], float] | None = None,
                 refresh_limit: int = 1024) -> None:
        self.nc = nc
        self.bucket = bucket
        self.on_put = on_put
        self.on_delete = on_delete
        self.on_synced = on_synced
        self.check_s = check_s
        self.inactive_s = inactive_s
        self.ready = asyncio.Event()
        #: Keys currently live, as last delivered.
        self.keys: set[str] = set()
        #: How many times the watch was (re-)created; the time of the last snapshot (monotonic).
        self.watches = 0
        self.synced_at = 0.0
        #: The live watch (None between watches).
        self.watcher: KeyValue.KeyWatcher | None = None
        self.keep_vanished = keep_vanished
        #: Keys missing from a snapshot, kept until their timer reports them deleted.
        self.vanished: dict[str, asyncio.TimerHandle] = {}
        #: The highest stream sequence the live watch applied: a direct read (:meth:`refresh`)
        #: older than it is already known (the watch delivers in stream order).
        self.revision = 0
        self.kv: KeyValue | None = None
        #: Per key, the last :meth:`refresh` (monotonic start, its task): one read at a time and
        #: at most one every ``every_s``, however many requests ask; reads of at most
        #: ``refresh_limit`` distinct keys per ``every_s``.
        self.refresh_limit = refresh_limit
        self._refreshes: dict[str, tuple[float, asyncio.Task[bool]]] = {}
        #: Keys a direct read put ahead of the watch, with that read's revision: the watch's older
        #: entries for them are skipped (no going back for a moment) until it catches up.
        self._ahead: dict[str, int] = {}
        self._misses = 0
        self._js = nc.jetstream()
        natsinternals.check()  # here, at start-up, rather than in the loop below

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def refresh(self, key: str, *, timeout: float = 0.5, every_s: float = 1.0) -> bool:
        """Read ``key`` from the bucket now, ahead of the watch, and apply it if the watch has not
        yet (True if that changed what the follower holds). For a caller about to refuse on what
        the watch has not delivered yet: a node registered a moment ago, a key created just now.
        At most one read per key per ``every_s`` (requests naming keys that do not exist cost one
        JetStream read a second each, not one per request), and none past ``refresh_limit``
        distinct keys a second, nor for a key longer than 256 characters; concurrent callers
        share the read."""
        if len(key) > _MAX_KEY:
            return False
        now = time.monotonic()
        last = self._refreshes.get(key)
        if last is not None:
            if not last[1].done():
                return await asyncio.shield(last[1])
            if now - last[0] < every_s:
                return False
        if last is None and len(self._refreshes) >= self.refresh_limit:
            self._refreshes = {k: v for k, v in self._refreshes.items()
                               if not v[1].done() or now - v[0] < every_s}
            if len(self._refreshes) >= self.refresh_limit:
                return False
        task = asyncio.ensure_future(self._read(key, timeout))
        self._refreshes[key] = (now, task)
        return await asyncio.shield(task)

    async def _read(self, key: str, timeout: float) -> bool:
        kv = self.kv
        if kv is None or self.watcher is None:
            return False  # between watches: the next snapshot brings everything
        watch = self.watches
        try:
            entry: KeyValue.Entry | None = await asyncio.wait_for(kv.get(key), timeout)
        except KeyNotFoundError as exc:  # never written, or its latest is a delete marker
            entry = exc.entry
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # invalid key, no answer in time, broker away
            log.debug("direct read of %s.%s: %s", self.bucket, key, exc)
            return False
        rev = entry.revision if entry is not None else None
        if entry is None or rev is None or watch != self.watches or rev <= self.revision:
            return False  # nothing there, or the watch has it (or newer) already
        self._ahead[key] = rev
        if entry.operation in _DELETE_OPS or not entry.value:
            known = key in self.keys
            self._drop(key)
            return known
        self._put(key, entry.value)
        return True

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for handle in self.vanished.values():
                handle.cancel()
            self.vanished.clear()

    async def _run(self) -> None:
        link = link_of(self.nc)
        backoff = 0.1
        while not link.closed.is_set():
            gen = link.generation
            try:
                kv = await ensure_kv(self._js, self.bucket, wait_s=0)  # this loop retries
                watcher = await watch_bucket(kv, inactive_s=self.inactive_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # broker or JetStream not back yet
                log.debug("watch on %s not ready: %s", self.bucket, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            self._misses = 0
            self.watches += 1
            self.revision = 0  # a broker that lost its state numbers from 1 again
            self._ahead.clear()
            self.kv = kv
            self.watcher = watcher
            try:
                reason = await self._consume(watcher, kv, gen)
            finally:
                self.watcher = None
                await drop_watch(watcher, self.nc)
            log.info("re-watching %s: %s", self.bucket, reason)

    async def _consume(self, watcher: KeyValue.KeyWatcher, kv: KeyValue, gen: int) -> str:
        """Apply entries until the watch must be re-created; returns why."""
        link = link_of(self.nc)
        seen: set[str] | None = set()  # keys of the snapshot being read; None once it is done
        got = False  # any entry of this watch yet
        unsure = False  # an early "nothing pending" the server has not confirmed yet
        reconnect = asyncio.ensure_future(link.reconnected(gen))
        nxt: asyncio.Future[Any] | None = None
        last_check = time.monotonic()
        try:
            while True:
                if nxt is None:  # the next entry, nats-py's "nothing pending" marker or its stop sentinel
                    nxt = asyncio.ensure_future(watcher.updates(timeout=None))  # type: ignore[no-untyped-call]
                done, _ = await asyncio.wait({nxt, reconnect}, timeout=self.check_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if nxt in done:
                    entry = nxt.result()
                    nxt = None
                    if isinstance(entry, KeyValue.Entry):
                        got = True
                        self._apply(entry, seen)
                        if seen is not None and entry.delta == 0:
                            self._synced(seen)
                            seen = None
                    elif entry is None and seen is not None:  # nats-py: "nothing pending"
                        empty = True if got else await snapshot_empty(watcher, self._js, min(self.check_s, 2.0))
                        if empty:
                            self._synced(seen)
                            seen = None
                        unsure = empty is None  # False: the entries are on their way
                    elif entry is not None:  # stopped under us
                        return "watch stopped"
                    if time.monotonic() - last_check < self.check_s:
                        continue
                if reconnect.done():
                    return "reconnected"
                last_check = time.monotonic()
                if unsure and seen is not None and not got:
                    empty = await snapshot_empty(watcher, self._js, min(self.check_s, 2.0))
                    if empty:
                        self._synced(seen)
                        seen = None
                    unsure = empty is None
                if not await self._alive(watcher):
                    return "watch consumer lost"
        finally:
            for fut in (nxt, reconnect):
                if fut is not None and not fut.done():
                    fut.cancel()

    def _apply(self, entry: KeyValue.Entry, seen: set[str] | None) -> None:
        key = entry.key
        rev = entry.revision or 0
        self.revision = max(self.revision, rev)
        ahead = self._ahead.get(key)
        if ahead is not None:
            if rev >= ahead:
                del self._ahead[key]
            if rev <= ahead:  # a direct read applied this entry, or a later one, already
                if seen is not None and key in self.keys:
                    seen.add(key)
                return
        if entry.operation in _DELETE_OPS or not entry.value:
            if seen is not None:
                seen.discard(key)
            self._drop(key)
            return
        if seen is not None:
            seen.add(key)
        self._put(key, entry.value)

    def _put(self, key: str, value: bytes) -> None:
        kept = self.vanished.pop(key, None)
        if kept is not None:
            kept.cancel()
        self.keys.add(key)
        self.on_put(key, value)

    def _drop(self, key: str) -> None:
        kept = self.vanished.pop(key, None)
        if kept is not None:
            kept.cancel()
        if key in self.keys:
            self.keys.discard(key)
            self.on_delete(key)

    def _synced(self, seen: set[str]) -> None:
        gone = self.keys - seen  # deleted while we were not watching (no marker left), or lost
        if gone:
            log.info("%s: %d key(s) missing from the new snapshot: %s", self.bucket, len(gone),
                     ", ".join(sorted(gone)[:5]))
        for key in gone:
            keep = self.keep_vanished(key) if self.keep_vanished is not None else 0.0
            if keep <= 0:
                self._drop(key)
            elif key not in self.vanished:  # an earlier snapshot's timer keeps running
                self.vanished[key] = asyncio.get_running_loop().call_later(keep, self._drop, key)
        self.synced_at = time.monotonic()
        self.ready.set()
        if self.on_synced is not None:
            self.on_synced()

    async def _alive(self, watcher: KeyValue.KeyWatcher) -> bool:
        """False if the watch's consumer is gone, or two checks in a row got no answer (its
        server died while ours lives on; a reconnect is handled without asking)."""
        if not self.nc.is_connected:
            return True  # the reconnect will re-create it
        consumer = natsinternals.watch_consumer(watcher)
        if consumer is None:
            return False
        try:
            await self._js.consumer_info(*consumer, timeout=self.check_s)
        except NotFoundError:
            return False
        except asyncio.CancelledError:
            raise
        except Exception:
            self._misses += 1
            return self._misses < 2
        self._misses = 0
        return True
