"""Queue-on-saturation: requests wait in a JetStream stream until a node has room.

When a policy has ``queue_on_saturation = true`` and every node is saturated, the router
publishes the request (with its reply inbox and deadline in headers) to ``zml.queue.<model>``
in the work-queue stream ``ZML_QUEUE`` instead of failing with QUEUE_FULL. Each model has one
durable pull consumer shared by all router replicas; each replica holds a window of the waiting
entries (``max_ack_pending``: one without flow control, so requests leave in arrival order) and,
as capacity frees (local completions, peer deltas, state updates), dispatches the best of them
(``rank``). A holder keeps its entries with ``in_progress`` every ``KEEPALIVE_S``; if it dies,
JetStream hands them to another replica ``ACK_WAIT_S`` (1 s) after its last one, and until then
the others leave freed slots to the best band it announced. The queue is on disk, so it survives
router (and broker) restarts. A request whose deadline passes answers QUEUE_FULL.

Never dispatched twice: the head stays unacknowledged until a node has taken it (a node that
refuses it at once hands it back to the holder, which keeps its place), so a holder dying
between dispatch and ack would leave JetStream to redeliver an entry that is already running.
Before dispatching, the holder therefore *claims* the entry: a create-only key (the entry's
stream sequence) in the KV bucket ``zml_queue_claims``, which at most one replica can create.
A replica that receives an entry already claimed by a replica that has gone silent acks and
drops it (the request ran, or died with the replica running it: its caller gets a timeout,
never a second answer); one claimed by a live replica (handed on after that holder stalled past
``ACK_WAIT_S``) is left to it, unacknowledged. A refused dispatch deletes the claim, so the
holder may claim again. No claim, no dispatch: if the bucket cannot be reached the head waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.bus.link import link_of
from zmlcore.messages import QueueBusy, queue_busy_decoder
from zmlcore.bus.ensure import ensure, ensure_kv
from zmlcore.flowctl.order import first_with_room
from zmlcore.runtime.runner import cancel_and_wait

from zml_router.incoming import QueuedMsg

log = logging.getLogger("zml.router.queue")
_encode = msgspec.json.encode

H_REPLY = subjects.H_QUEUE_REPLY
H_DEADLINE = subjects.H_QUEUE_DEADLINE
H_ENQUEUED = subjects.H_QUEUE_ENQUEUED
H_TOTAL_MS = subjects.H_QUEUE_TOTAL_MS
#: Headers a queued request keeps: its id, timeout and owner, its API key's options (default
#: policy, cost label), what its requester handles (reply parts, keepalives), and its W3C trace context (the spans of the router that serves it join
#: the trace that queued it).
H_QUEUED_HEADERS = (subjects.H_REQUEST_ID, subjects.H_TIMEOUT_MS, subjects.H_OWNER, subjects.H_DEFAULT_POLICY,
                    subjects.H_LABEL, subjects.H_ACCEPT_PARTS, subjects.H_ACCEPT_STREAM,
                    subjects.H_ACCEPT_ROUTING, subjects.H_KEEPALIVE, "traceparent", "tracestate",
                    subjects.H_ID_CLAIM,  # a queued request keeps its claim on its id (zml_router.replicas.ids)
                    # a gateway's validated body and its ZML fields (zmlcore.messages.frontdoor)
                    subjects.H_BODY, subjects.H_POLICY, subjects.H_ACCELERATOR_ID, subjects.H_PREFIX_KEYS,
                    # flow control: its band, targets, key's flow options and tenant (zmlcore.flowctl)
                    subjects.H_PRIORITY, subjects.H_TTFT_SLO_MS, subjects.H_TPOT_SLO_MS, subjects.H_PRIORITY_DEFAULT,
                    subjects.H_PRIORITY_MAX, subjects.H_TENANT_WEIGHT, subjects.H_TENANT)

#: A held entry comes back to the other replicas this long after its holder last said it is
#: alive (``in_progress``, every ``KEEPALIVE_S``): short, so that a dead holder's entries are
#: ranked again within a second instead of the survivors serving lower bands meanwhile
#: (benches/flow_chaos.py: 5 s let a survivor serve its standard entries before a dead peer's
#: critical ones). A live holder stalled longer than ``ACK_WAIT_S - KEEPALIVE_S`` only makes its
#: entries held twice for a while: the claims still let one replica dispatch each.
ACK_WAIT_S = 1.0
#: The holder's heartbeat: every held entry's ``in_progress`` and the "requests waiting"
#: announcement (with the best band held), from a task of their own, not from the dispatch
#: passes (a placement waits up to 0.5 s).
KEEPALIVE_S = 0.25
#: A holder's long poll for new entries. Short: a pull request the client gave up on can still
#: be handed an entry by the server, which then waits for this replica's next poll.
FETCH_S = 1.0
#: Queued entries live at most this long (the stream's max_age), and so do their claims.
MAX_AGE_S = 3600.0
#: How long a "requests waiting" announcement (and the band in it) holds unless renewed; the
#: holder renews it every ``KEEPALIVE_S``. Longer than ``ACK_WAIT_S``: a replica that dies
#: holding critical entries keeps its peers leaving freed slots to that band until JetStream
#: has handed the entries to them, and no longer (a replica that empties says so at once).
BUSY_TTL_S = ACK_WAIT_S + 0.5
assert BUSY_TTL_S - KEEPALIVE_S > ACK_WAIT_S


def key_of(jmsg) -> str:  # type: ignore[no-untyped-def]
    """The model key of a queued JetStream message (last token of its subject)."""
    return str(jmsg.subject).rsplit(".", 1)[-1]


model_key = subjects.queue_key  # the dashboard names the queues' models with it too


#: Entries held (by arrival), their stream sequences -> (indexes best first, indexes to shed,
#: the best entry's band).
Rank = Callable[[list[QueuedMsg], list[int]], tuple[list[int], list[int], tuple[int, int]]]


def _fifo(qmsgs: list[QueuedMsg], seqs: list[int]) -> tuple[list[int], list[int], tuple[int, int]]:
    return list(range(len(qmsgs))), [], (1, 0)


# queued message -> True if a node has room for it now.
HasRoom = Callable[[QueuedMsg], bool]
# (queued message, deadline) -> True once a node has taken it, False if it refused it at once.
Dispatch = Callable[[QueuedMsg, float], Awaitable[bool]]
Expire = Callable[[QueuedMsg, float], Awaitable[None]]


class SaturationQueue:
    def __init__(self, nc: NATS, has_room: HasRoom, dispatch: Dispatch, expire: Expire,
                 is_cancelled: Callable[[QueuedMsg], bool], owner: str = "", *, rank: Rank | None = None,
                 shed: Expire | None = None, window: int = 1) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self._has_room = has_room
        self._dispatch = dispatch
        self._owner = owner.encode() or b"router"
        self.claims: KeyValue | None = None
        self._expire = expire
        self._is_cancelled = is_cancelled
        self._workers: dict[str, asyncio.Task[None]] = {}
        #: Set whenever capacity may have freed; waiting heads re-try then.
        self.capacity = asyncio.Event()
        #: model key -> until when it has requests waiting (announced by any replica), so a new
        #: arrival queues behind them instead of overtaking them when a slot frees.
        self.busy: dict[str, float] = {}
        self._busy_sub: object | None = None
        #: Entries held per model at once, ordered by ``rank`` (zmlcore.flowctl.order through the
        #: glue); past what ``rank`` keeps they are answered with ``shed``.
        self.window = window
        self._rank: Rank = rank or _fifo
        self._shed_cb = shed
        #: (model key, replica) -> ((the best band it holds waiting, over-share?), until when)
        self.peer_bands: dict[tuple[str, str], tuple[tuple[int, int], float]] = {}
        #: model key -> the best (band, over-share) this replica last announced
        self._mine: dict[str, tuple[int, int]] = {}
        #: (model key, replica) -> the entries it announced holding; model key -> ours
        self.peer_held: dict[tuple[str, str], int] = {}
        self._held_n: dict[str, int] = {}
        #: model key -> the count of entries held we last announced
        self._told: dict[str, int] = {}
        self.keepalive_s = KEEPALIVE_S

    async def _ensure_stream(self) -> None:
        cfg = StreamConfig(
            name=subjects.QUEUE_STREAM,
            subjects=[f"{subjects.QUEUE_SUBJECT_PREFIX}.>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=MAX_AGE_S,
            num_replicas=link_of(self.nc).replicas,
        )
        await ensure(lambda: self.js.stream_info(subjects.QUEUE_STREAM), lambda: self.js.add_stream(cfg),
                     f"stream {subjects.QUEUE_STREAM}")

    async def start(self, models: list[str]) -> None:
        await self._ensure_stream()
        self.claims = await self._claims_bucket()
        # Models in the config, plus any with a consumer already (a queue left by a restart).
        try:
            for info in await self.js.consumers_info(subjects.QUEUE_STREAM):
                fs = info.config.filter_subject or ""
                if fs.startswith(subjects.QUEUE_SUBJECT_PREFIX + "."):
                    self._ensure_worker_key(fs.rsplit(".", 1)[-1])
        except Exception:
            log.debug("could not list queue consumers", exc_info=True)
        for model in models:
            self._ensure_worker_key(model_key(model))
        self._busy_sub = await self.nc.subscribe(subjects.QUEUE_BUSY, cb=self._on_busy)

    async def _claims_bucket(self) -> KeyValue:
        return await ensure_kv(self.js, subjects.QUEUE_CLAIMS_BUCKET, ttl=MAX_AGE_S)

    async def _claim(self, key: str) -> bool | None:
        """True: ours to dispatch; False: claimed already (dispatched); None: bucket unreachable."""
        if self.claims is None:
            return None
        try:
            await self.claims.create(key, self._owner)
            return True
        except KeyWrongLastSequenceError:
            return False
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("queue claim %s failed; holding the entry", key, exc_info=True)
            return None

    async def _claimer(self, key: str) -> str | None:
        """Which replica claimed the entry (None: never claimed, or released, or unknown: the
        claim at dispatch time decides)."""
        if self.claims is None:
            return None
        try:
            entry = await self.claims.get(key)
            return (entry.value or b"").decode() or "?"
        except (KeyNotFoundError, KeyDeletedError):  # never claimed, or released
            return None
        except asyncio.CancelledError:
            raise
        except Exception:
            return None

    def _alive(self, router: str) -> bool:
        """Is ``router`` this replica, or one holding entries that announced itself within
        ``BUSY_TTL_S`` (its heartbeat, ``_keepalive``)?"""
        if router == self._owner.decode():
            return True
        now = time.time()
        return any(rid == router and until > now for (_, rid), (_, until) in self.peer_bands.items())

    async def _claimed_elsewhere(self, jmsg, claim_key: str, claimer: str) -> None:  # type: ignore[no-untyped-def]
        """An entry another replica claimed (it is dispatching it, or did). Its claimer alive: left
        to it, unacknowledged (its ``in_progress`` keeps it, its ack ends it, and a dispatch the
        node refused goes back to it with its claim released); acked here, it would be gone
        from the stream while its claimer may still need it back. Only with ``ACK_WAIT_S`` short
        does this happen to a live holder: one stalled past it has its entries handed on.
        Its claimer dead (silent past ``BUSY_TTL_S``): it ran, or died with that replica; no
        dispatch, and no QUEUE_FULL either: its caller may be reading its answer."""
        if self._alive(claimer):
            return
        log.warning("queued request %s was dispatched by a replica that died before acking it; "
                    "not dispatching it again", (jmsg.headers or {}).get(subjects.H_REQUEST_ID) or claim_key)
        await jmsg.ack()

    async def _release(self, key: str) -> None:
        if self.claims is None:
            return
        try:
            await self.claims.delete(key)
        except asyncio.CancelledError:
            raise
        except Exception:  # the claim stays: the entry is dropped rather than risk running twice
            log.warning("queue claim %s not released", key, exc_info=True)

    def has_waiting(self, model: str) -> bool:
        return self.busy.get(model_key(model), 0.0) > time.time()

    def best_waiting(self, model: str) -> tuple[int, int] | None:
        """The best (band, over-share) of what waits for ``model``, here or announced by a peer
        (None: none known)."""
        key = model_key(model)
        tops = [t for t in (self._mine.get(key), self._best(key)) if t is not None]
        return min(tops) if tops else None

    def waiting(self, model: str) -> tuple[tuple[int, int] | None, dict[str, int]]:
        """What waits for ``model``: the best (band, over-share), here or announced
        (:meth:`best_waiting`), and the replicas holding entries of it with how many, as each
        announced them (ours too: the replicas then split the nodes' spare slots by the same
        numbers, zmlcore.flowctl.gate.spare_part; by our live count, two windows of nearly the
        same size each took the larger part while the other's announcement was a few entries old)."""
        key = model_key(model)
        now = time.time()
        held = {rid: self.peer_held.get((k, rid), 0) for (k, rid), (_, until) in self.peer_bands.items()
                if k == key and until > now and self.peer_held.get((k, rid), 0) > 0}
        if self._held_n.get(key, 0):  # as we announced it: every replica splits by the same counts
            held[self._owner.decode()] = max(1, self._told.get(key, 0))
        return self.best_waiting(model), held

    async def _announce(self, key: str, until: float, top: tuple[int, int] = (9, 0)) -> None:
        self.busy[key] = until
        self._told[key] = self._held_n.get(key, 0)
        try:
            await self.nc.publish(subjects.QUEUE_BUSY, _encode(QueueBusy(key=key, until=until, band=top[0],
                                                                         router=self._owner.decode(),
                                                                         over=bool(top[1]),
                                                                         held=self._held_n.get(key, 0))))
        except Exception:  # an announcement is an optimisation of fairness, never fatal
            pass

    async def _on_busy(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            busy = queue_busy_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.busy[busy.key] = max(busy.until, self.busy.get(busy.key, 0.0)) if busy.until else busy.until
        if busy.router and busy.router != self._owner.decode():
            self.peer_bands[(busy.key, busy.router)] = ((busy.band, int(busy.over)), busy.until)
            self.peer_held[(busy.key, busy.router)] = busy.held

    async def stop(self) -> None:
        await cancel_and_wait(self._workers.values())

    async def enqueue(self, model: str, data: bytes, reply: str, headers: dict[str, str], deadline: float) -> None:
        key = model_key(model)
        self._ensure_worker_key(key)
        h = {k: v for k, v in headers.items() if k in H_QUEUED_HEADERS}
        h[H_REPLY] = reply
        h[H_DEADLINE] = f"{deadline:.3f}"
        h[H_ENQUEUED] = headers.get(H_ENQUEUED) or f"{time.time():.3f}"
        await self.js.publish(subjects.queue(key), data, headers=h)
        # With the best band held here, if any: without one the peers took this replica for
        # holding nothing ranked until its next heartbeat (and took a freed slot from its critical).
        await self._announce(key, time.time() + BUSY_TTL_S, self._mine.get(key, (9, 0)))

    def _ensure_worker_key(self, key: str) -> None:
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._work(key))

    async def _work(self, key: str) -> None:
        durable = subjects.queue_consumer(key)
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=self.window,
            filter_subject=subjects.queue(key),
        )
        link = link_of(self.nc)
        while True:
            # (Re-)create the pull consumer: at start, and after every reconnect, since a broker
            # restarted without its store (or a lost cluster server) no longer has it.
            gen = link.generation
            try:
                if gen:  # a broker that lost its store lost the claims bucket too
                    await self._ensure_stream()
                    self.claims = await self._claims_bucket()
                try:  # an existing consumer takes this window (JetStream updates max_ack_pending in place)
                    await self.js.add_consumer(subjects.QUEUE_STREAM, config)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.debug("queue consumer %s not updated", durable, exc_info=True)
                psub = await self.js.pull_subscribe(subjects.queue(key), durable=durable,
                                                    stream=subjects.QUEUE_STREAM, config=config)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("queue consumer %s not ready; retrying", durable, exc_info=not gen)
                await asyncio.sleep(0.5)
                continue
            await self._fetch_loop(key, psub, lambda: link.generation != gen)
            try:
                await psub.unsubscribe()
            except Exception:  # connection gone
                pass

    async def _fetch_loop(self, key: str, psub, stale: Callable[[], bool]) -> None:  # type: ignore[no-untyped-def]
        """Hold up to ``window`` entries of the model's queue and dispatch them in the order
        ``rank`` gives (zmlcore.flowctl.order: band, share, arrival) as capacity frees."""
        held: dict[int, _Held] = {}
        arrived = asyncio.Event()
        fetcher = asyncio.create_task(self._fetch(key, psub, stale, held, arrived))
        alive = asyncio.create_task(self._keepalive(key, held))
        try:
            while not stale() and not fetcher.done():
                if not held:
                    arrived.clear()
                    await asyncio.wait([asyncio.ensure_future(arrived.wait()), fetcher],
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                if await self._serve(key, held) or not held:
                    continue  # one placed: rank again at once (a newcomer may come first)
                self.capacity.clear()
                arrived.clear()
                waits = [asyncio.ensure_future(self.capacity.wait()), asyncio.ensure_future(arrived.wait())]
                done, pending = await asyncio.wait(waits, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                for w in pending:
                    w.cancel()
        finally:
            for task in (fetcher, alive):
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    async def _keepalive(self, key: str, held: dict[int, _Held]) -> None:
        """While entries are held: every ``KEEPALIVE_S``, tell JetStream we are alive (so they
        are not handed to another replica) and the other replicas that this model has requests
        waiting and the best band held here (``_serve`` also announces at once when it changes)."""
        while True:
            await asyncio.sleep(self.keepalive_s)
            if not held:
                continue
            try:
                for e in list(held.values()):
                    await e.jmsg.in_progress()
                top = self._mine.get(key)
                if top is not None:
                    await self._announce(key, time.time() + BUSY_TTL_S, top)
            except asyncio.CancelledError:
                raise
            except Exception:  # the connection is down: its entries come back to whoever polls next
                log.debug("queue keepalive for %s failed", key, exc_info=True)

    async def _fetch(self, key: str, psub, stale: Callable[[], bool], held: dict[int, _Held],  # type: ignore[no-untyped-def]
                     arrived: asyncio.Event) -> None:
        while not stale():
            room = self.window - len(held)
            if room <= 0:
                await asyncio.sleep(0.05)
                continue
            try:
                # One at a time while waiting (a fetch of N waits for N or its timeout), then
                # what else is there at once (a fetch finds waiting entries without waiting).
                msgs = await psub.fetch(1, timeout=FETCH_S)
                if room > 1:
                    try:
                        msgs += await psub.fetch(room - 1, timeout=0.02)
                    except (NatsTimeout, asyncio.TimeoutError):
                        pass
            except (NatsTimeout, asyncio.TimeoutError):
                if not held and self.busy.get(key, 0.0) > time.time():
                    await self._announce(key, 0.0)  # nothing left waiting: arrivals go direct
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("queue fetch failed on %s: %s", key, exc)
                await asyncio.sleep(0.5)
                continue
            for jmsg in msgs:
                entry = await self._take(jmsg, held)
                if entry is not None:
                    held[entry.seq] = entry
            arrived.set()

    async def _take(self, jmsg, held: dict[int, _Held]) -> _Held | None:  # type: ignore[no-untyped-def]
        h = dict(jmsg.headers or {})
        qmsg = QueuedMsg(subject=subjects.INFER, data=jmsg.data, reply=h.pop(H_REPLY, ""), headers=h)
        seq = jmsg.metadata.sequence.stream
        claim_key = f"{key_of(jmsg)}.{seq}"
        if seq in held:  # back to its holder (a stall past ACK_WAIT_S): one entry, the newest delivery
            held[seq].jmsg = jmsg
            return None
        if jmsg.metadata.num_delivered > 1:
            claimer = await self._claimer(claim_key)
            if claimer is not None:
                await self._claimed_elsewhere(jmsg, claim_key, claimer)
                return None
        return _Held(jmsg, qmsg, float(h.get(H_DEADLINE, "0") or 0), claim_key, seq)

    async def _serve(self, key: str, held: dict[int, _Held]) -> bool:
        """One pass over the held entries: answer the cancelled and expired, shed past the
        window's limit, dispatch the best that fits (zmlcore.flowctl.order.first_with_room; one
        per pass: placing it takes until its first token, and whatever arrived meanwhile is
        ranked before the next). True when one was dispatched (or dropped): rank again at once."""
        now = time.time()
        for e in list(held.values()):
            if e.qmsg.headers.get(subjects.H_REQUEST_ID) and self._is_cancelled(e.qmsg):
                del held[e.seq]
                await e.jmsg.ack()
            elif now >= e.deadline:
                del held[e.seq]
                await e.jmsg.ack()
                await self._expire(e.qmsg, float(e.qmsg.headers.get(H_ENQUEUED, now)))
        entries = sorted(held.values(), key=lambda e: e.seq)
        self._held_n[key] = len(entries)
        if not entries:
            await self._emptied(key)
            self._rank([], [])  # nothing held: the order's state (each tenant's backlog here) empties
            return False
        order, shed, top = self._rank([e.qmsg for e in entries], [e.seq for e in entries])
        for i in shed:
            e = entries[i]
            held.pop(e.seq, None)
            await e.jmsg.ack()
            if self._shed_cb is not None:
                await self._shed_cb(e.qmsg, float(e.qmsg.headers.get(H_ENQUEUED, now)))
        placed = again = False
        best = self._best(key)
        # Another replica holding better-ranked work waiting: the slot is its.
        if best is None or top <= best:
            live = [i for i in order if entries[i].seq in held]
            pick = first_with_room(live, lambda j, ahead: self._has_room(_offered(entries[j].qmsg, ahead)))
            chosen = entries[pick] if pick is not None else None
            claimed = await self._claim(chosen.claim_key) if chosen is not None else None
            if chosen is None or claimed is None:
                pass  # no room; or the claims bucket is unreachable: nothing goes until it is back
            elif claimed is False:  # another replica holds it too (handed on after a stall) and claimed it first
                held.pop(chosen.seq, None)
                again = True
                claimer = await self._claimer(chosen.claim_key)
                if claimer is not None:  # (None: released since: its holder keeps it, or it comes back)
                    await self._claimed_elsewhere(chosen.jmsg, chosen.claim_key, claimer)
            elif await self._dispatch(chosen.qmsg, chosen.deadline):
                held.pop(chosen.seq, None)
                await chosen.jmsg.ack()
                placed = True
            else:
                await self._release(chosen.claim_key)  # refused before running: still to place
        # The rest stay held (``_keepalive`` keeps them so); the other replicas learn at once
        # when the best band held here changes, or that nothing is held any more (then they no
        # longer leave freed slots to this replica).
        self._held_n[key] = len(held)
        if held:
            if self._mine.get(key) != top or _moved(self._told.get(key, 0), len(held)):
                self._mine[key] = top
                await self._announce(key, now + BUSY_TTL_S, top)
        else:
            await self._emptied(key)
            self._rank([], [])
        return placed or again

    async def _emptied(self, key: str) -> None:
        """Nothing of ``key`` is held here any more: said once, so that the other replicas stop
        leaving freed slots to a band this replica no longer holds (its announcement would
        otherwise stand until it expires). No band, and an ``until`` of now: it extends nobody's
        "requests waiting" (``_on_busy`` keeps the latest)."""
        if self._mine.pop(key, None) is None:
            return
        self._told[key] = 0
        try:
            await self.nc.publish(subjects.QUEUE_BUSY, _encode(QueueBusy(key=key, until=time.time(),
                                                                         router=self._owner.decode())))
        except Exception:  # as _announce: an optimisation, never fatal
            pass

    def _best(self, key: str) -> tuple[int, int] | None:
        """The best (band, over-share) another replica announced waiting for this model (None: none)."""
        now = time.time()
        tops = [top for (k, rid), (top, until) in self.peer_bands.items() if k == key and until > now]
        return min(tops) if tops else None


def _moved(before: int, now: int) -> bool:
    """Has the count of entries held moved enough to tell the peers before the next heartbeat?
    From or to 1 (a holder's one spare slot), or by a quarter: the nodes' spare slots are
    shared by it (zmlcore.flowctl.gate.spare_part), and a count a heartbeat stale only shifts
    a part where two windows are nearly equal."""
    return before != now and (min(before, now) <= 1 or abs(now - before) * 4 >= max(before, now))


def _offered(qmsg: QueuedMsg, ahead: int) -> QueuedMsg:
    """The entry as offered a slot, ``ahead`` entries ranked before it (its dispatch keeps it)."""
    qmsg.ahead = ahead
    return qmsg


@dataclass(slots=True)
class _Held:
    """A queue entry this replica holds (unacknowledged in JetStream) until it is dispatched."""

    jmsg: Any
    qmsg: QueuedMsg
    deadline: float
    claim_key: str
    seq: int
