"""Queue-on-saturation: requests wait in a JetStream stream until a node has room.

When a policy has ``queue_on_saturation = true`` and every node is saturated, the router
publishes the request (with its reply inbox and deadline in headers) to ``zml.queue.<model>``
in the work-queue stream ``ZML_QUEUE`` instead of failing with QUEUE_FULL. Each model has one
durable pull consumer shared by all router replicas with ``max_ack_pending = 1``: exactly one
replica holds the head of a model's queue at a time, so requests leave in arrival order. The
holder waits for capacity (local completions, peer deltas, state updates), then dispatches. If
it dies while waiting, JetStream redelivers the head to another replica after ``ack_wait``; the
queue is on disk, so it survives router (and broker) restarts. A request whose deadline passes
answers QUEUE_FULL.

Never dispatched twice: the head stays unacknowledged until a node has taken it (a node that
refuses it at once hands it back to the holder, which keeps its place), so a holder dying
between dispatch and ack would leave JetStream to redeliver an entry that is already running.
Before dispatching, the holder therefore *claims* the entry: a create-only key (the entry's
stream sequence) in the KV bucket ``zml_queue_claims``, which at most one replica can create.
A replica that receives an entry already claimed acks and drops it (the request ran, or died
with the replica running it: its caller gets a timeout, never a second answer). A refused
dispatch deletes the claim, so the holder may claim again. No claim, no dispatch: if the
bucket cannot be reached the head waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
                    subjects.H_BODY, subjects.H_POLICY, subjects.H_ACCELERATOR_ID, subjects.H_PREFIX_KEYS)

ACK_WAIT_S = 5.0
#: Queued entries live at most this long (the stream's max_age), and so do their claims.
MAX_AGE_S = 3600.0
#: How long a "requests waiting" announcement holds unless renewed (the holder renews it).
BUSY_TTL_S = 2.0


def key_of(jmsg) -> str:  # type: ignore[no-untyped-def]
    """The model key of a queued JetStream message (last token of its subject)."""
    return str(jmsg.subject).rsplit(".", 1)[-1]


model_key = subjects.queue_key  # the dashboard names the queues' models with it too


# queued message -> True if a node has room for it now.
HasRoom = Callable[[QueuedMsg], bool]
# (queued message, deadline) -> True once a node has taken it, False if it refused it at once.
Dispatch = Callable[[QueuedMsg, float], Awaitable[bool]]
Expire = Callable[[QueuedMsg, float], Awaitable[None]]


class SaturationQueue:
    def __init__(self, nc: NATS, has_room: HasRoom, dispatch: Dispatch, expire: Expire,
                 is_cancelled: Callable[[QueuedMsg], bool], owner: str = "") -> None:
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

    async def _is_claimed(self, key: str) -> bool:
        if self.claims is None:
            return False
        try:
            await self.claims.get(key)
            return True
        except (KeyNotFoundError, KeyDeletedError):  # never claimed, or released
            return False
        except asyncio.CancelledError:
            raise
        except Exception:  # unknown: the claim at dispatch time decides
            return False

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

    async def _announce(self, key: str, until: float) -> None:
        self.busy[key] = until
        try:
            await self.nc.publish(subjects.QUEUE_BUSY, _encode(QueueBusy(key=key, until=until)))
        except Exception:  # an announcement is an optimisation of fairness, never fatal
            pass

    async def _on_busy(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            busy = queue_busy_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.busy[busy.key] = busy.until

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
        await self._announce(key, time.time() + BUSY_TTL_S)

    def _ensure_worker_key(self, key: str) -> None:
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._work(key))

    async def _work(self, key: str) -> None:
        durable = subjects.queue_consumer(key)
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=1,
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
        while not stale():
            try:
                msgs = await psub.fetch(1, timeout=1.0)
            except (NatsTimeout, asyncio.TimeoutError):
                if self.busy.get(key, 0.0) > time.time():
                    await self._announce(key, 0.0)  # nothing left waiting: arrivals go direct
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("queue fetch failed on %s: %s", key, exc)
                await asyncio.sleep(0.5)
                continue
            for jmsg in msgs:
                await self._serve_head(jmsg)

    async def _serve_head(self, jmsg) -> None:  # type: ignore[no-untyped-def]
        h = dict(jmsg.headers or {})
        qmsg = QueuedMsg(subject=subjects.INFER, data=jmsg.data, reply=h.pop(H_REPLY, ""), headers=h)
        deadline = float(h.get(H_DEADLINE, "0") or 0)
        request_id = h.get(subjects.H_REQUEST_ID, "")
        claim_key = f"{key_of(jmsg)}.{jmsg.metadata.sequence.stream}"
        if jmsg.metadata.num_delivered > 1 and await self._is_claimed(claim_key):
            # Redelivered after its holder died having dispatched it: it ran (or died with that
            # holder). No dispatch, and no QUEUE_FULL either: its caller may be reading its answer.
            log.warning("queued request %s was dispatched by a replica that died before acking it; "
                        "not dispatching it again", request_id or claim_key)
            await jmsg.ack()
            return
        last_progress = time.monotonic()
        while True:
            now = time.time()
            if request_id and self._is_cancelled(qmsg):
                await jmsg.ack()
                return
            if now >= deadline:
                await jmsg.ack()
                await self._expire(qmsg, float(h.get(H_ENQUEUED, now)))
                return
            self.capacity.clear()
            if self._has_room(qmsg):
                claimed = await self._claim(claim_key)
                if claimed is False:
                    log.warning("queued request %s was dispatched by a replica that died before acking it; "
                                "not dispatching it again", request_id or claim_key)
                    await jmsg.ack()
                    return
                if claimed:
                    if await self._dispatch(qmsg, deadline):
                        await jmsg.ack()
                        return
                    await self._release(claim_key)  # refused before running: still to place
            # Hold the head; tell JetStream we are alive so it is not redelivered elsewhere, and
            # the other replicas that this model still has requests waiting.
            if time.monotonic() - last_progress > ACK_WAIT_S / 3:
                await jmsg.in_progress()
                last_progress = time.monotonic()
            if self.busy.get(key_of(jmsg), 0.0) < now + BUSY_TTL_S / 2:
                await self._announce(key_of(jmsg), now + BUSY_TTL_S)
            try:
                await asyncio.wait_for(self.capacity.wait(), timeout=min(0.25, max(deadline - now, 0.01)))
            except asyncio.TimeoutError:
                pass
