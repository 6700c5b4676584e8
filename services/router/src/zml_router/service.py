"""The router: takes requests from ``zml.infer`` (queue group), decides, dispatches, replies.

This module is the outline: lifecycle, subscriptions, and the I/O that drives each request's
sans-I/O flow (``zml_router.flow``: decide -> dispatch -> fail over / queue / answer). The
parts live beside it: admission and the half-open breaker (``admission``), one attempt on a
node and the relayed reply (``relay``), in-flight counts and marks shared with the other
replicas (``inflight``), the saturation queue's glue (``saturation``, over ``queue``), ids
claimed across replicas (``ids``), plan limits (``limits``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from random import getrandbits
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.messages import frontdoor
from zmlcore.bus.publish import Publisher
from zmlcore.telemetry import tracing
from zmlcore.bus.batchpub import BatchPublisher
from zmlcore.reply.bigreply import check_fits
from zmlcore.config import ZMLConfig
from zmlcore.errors import CancelledError, DuplicateRequestError, ZMLError
from zmlcore.reply.keepalive import KeepaliveBook, keepalive_headers, parse_interval
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.messages import InferRequest, RoutingInfo
from zmlcore.messages.warmup import completed_encoder
from zmlcore.policy import RoutingState
from zmlcore.runtime.runner import cancel_and_wait
from zmlcore.telemetry.setup import DECISION_ID, REQUEST_ID
from zmlcore.messages.validate import check_request_id, decode_request, request_timeout_s
from zml_router import flow
from zml_router import ids as idclaims
from zml_router import tracing as rtrace
from zml_router.admission import Admission
from zml_router.cancels import CancelBook
from zml_router.cooldowns import Marks
from zml_router.dispatch import AttemptError, NodeClient
from zml_router.flow import Outcome
from zml_router.ids import RequestIds, claim_key
from zml_router.inflight import Sharing
from zml_router.keepalives import send_keepalives
from zml_router import limits as plan_limits
from zml_router.limits import IdentityLimits, Lease
from zml_router.metrics import RouterMetrics
from zml_router.queue import QueuedMsg, SaturationQueue
from zml_router.nodebody import NodeBodies
from zml_router.relay import Relay
from zml_router.rename import Renamer
from zml_router.saturation import QueueGlue, owner_key
from zml_router.table import NodeTable
from zml_router.timers import Wheel
from zml_router.trust import front_door_headers

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode
_EVENT_COMPLETED = subjects.event(subjects.EVENT_COMPLETED)
#: Completion events wait this long for others to go out with (health and warmup aggregate
#: them over seconds; one wake-up per batch instead of per request for every subscriber).
COMPLETED_WINDOW_S = 0.01


def _new_id() -> str:
    return os.urandom(8).hex()


def _decision_id() -> str:
    """Unique, not secret (it names a decision in logs and traces): no getrandom syscall per attempt."""
    return f"{getrandbits(64):016x}"


class RouterService:
    def __init__(self, cfg: ZMLConfig, router_id: str | None = None) -> None:
        self.cfg = cfg
        self.router_id = router_id or f"router-{_new_id()[:6]}"
        self.table = NodeTable(cfg.families())
        self.marks = Marks(self.table, self.router_id)
        self.state = RoutingState()
        self.admission = Admission(cfg.router, self.table, self.state)
        self.sharing = Sharing(self.table, self.marks, self.router_id)
        self.relay = Relay(self)
        self.glue = QueueGlue(self)
        self.nc: NATS | None = None
        self.pub: Publisher | None = None
        self.http: NodeClient | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: In-flight requests by (owner, front-door owner, request id): ids are scoped to owners.
        self._by_request: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []
        #: Cancelled requests (by owner key) not held here (not arrived yet, or waiting in the queue).
        self.cancelled = CancelBook()
        self.queue: SaturationQueue | None = None
        self._default_timeout = cfg.defaults.request_timeout_s
        self.metrics = RouterMetrics(self)
        #: Plans of NATS client identities (zml creds issue NAME --plan ...): zml_router.limits.
        self.limits = IdentityLimits()
        #: Requests whose requester asked for keepalives (zmlcore.reply.keepalive), by reply subject.
        self.keepalives = KeepaliveBook()
        #: Callers' request ids in flight on every replica (zml_router.ids).
        self.ids: RequestIds | None = None
        #: Completion events, published together every few ms (zmlcore.bus.batchpub).
        self.events: BatchPublisher | None = None
        #: Request and first-byte deadlines: one timer wheel, not a loop timer each (zml_router.timers).
        self.timers = Wheel()

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.pub = Publisher.of(nc)  # replies and stream chunks: one write per loop iteration
        self.http = NodeClient(self.cfg.router.max_connections, self.cfg.router.connect_timeout_s)
        self.events = BatchPublisher(nc, _EVENT_COMPLETED, COMPLETED_WINDOW_S)
        self.events.start()
        if self.cfg.router.stale_after_s < 2 * self.cfg.health.poll_interval_s:
            log.warning("[router] stale_after_s (%g s) is under two health polls (%g s each): nodes will "
                        "flap to stale between polls", self.cfg.router.stale_after_s, self.cfg.health.poll_interval_s)
        # Followers re-create their watch (and re-read the snapshot) after every reconnect.
        # A node a re-watch's snapshot lacks (no delete marker) ages out like one health stopped
        # updating, instead of vanishing from routing at once (zmlcore.bus.kvfollow says when).
        stale_s = self.cfg.router.stale_after_s
        self.nodes_follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=self.table.put_raw,
                                         on_delete=self.table.delete_raw,
                                         keep_vanished=lambda key: self.table.fresh_for(key, stale_s, time.time()))
        self._loops.append(asyncio.create_task(self.nodes_follower.run()))
        self._loops.append(asyncio.create_task(self.table.costs.follower(nc).run()))
        # A snapshot before taking traffic; an empty bucket has nothing to wait for.
        await self.nodes_follower.wait_ready(2.0)
        await self.limits.start(nc)
        self.ids = RequestIds(nc, self.router_id, self.cfg.defaults.max_request_timeout_s)
        await self.ids.open()
        glue = self.glue
        self.queue = SaturationQueue(nc, glue.has_room, glue.dispatch, glue.expire, glue.cancelled,
                                     owner=self.router_id)
        self.table.on_change = self.queue.capacity.set
        await self.queue.start(sorted(self.cfg.model_names()))
        self._subs += await self.sharing.start(nc, self.queue.capacity.set)
        self._loops.append(asyncio.create_task(self.sharing.publish_snapshots()))
        self._loops.append(asyncio.create_task(send_keepalives(self.keepalives, nc)))
        self.metrics.start()
        self._subs.append(await nc.subscribe(f"{subjects.CANCEL_PREFIX}.>", cb=self._on_cancel))
        self._subs.append(await nc.subscribe(subjects.router_state(self.router_id), cb=self._on_state))
        self._subs.append(await nc.subscribe(subjects.ROUTERS_STATE, cb=self._on_state))
        for subject in (subjects.INFER, subjects.FRONT_DOOR_INFER):
            self._subs.append(await nc.subscribe(subject, queue=subjects.ROUTER_QUEUE, cb=self._on_request))

    async def stop(self) -> None:
        # Stop taking new requests, let in-flight ones finish (bounded), then close.
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10)
        await cancel_and_wait(list(self._tasks))
        if self.queue is not None:
            await self.queue.stop()
        await cancel_and_wait(self._loops)
        self.timers.close()
        if self.events is not None:
            await self.events.stop()
        self.sharing.close()
        await self.metrics.stop()
        await self.limits.stop()
        if self.http:
            await self.http.aclose()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task the router waits for (bounded) when it stops."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- subscriptions ---------------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: hand off at once.
        front_door_headers(msg)  # what the sender may not set is dropped here (zml_router.trust)
        self.spawn(self.enter(msg))

    async def _on_cancel(self, msg: Msg) -> None:
        # The owner is the subject token that permissions pin to the sender's identity: a
        # cancel for another owner's request id names a different key and matches nothing.
        parsed = subjects.parse_cancel(msg.subject)
        if parsed is None:
            return
        owner, request_id = parsed
        key = claim_key(owner, (msg.headers or {}).get(subjects.H_OWNER, ""), request_id)
        task = self._by_request.get(key)
        if task is not None:
            task.cancel()
            return
        # Not arrived yet, or waiting in the saturation queue: remember it (bounded, expiring).
        self.cancelled.add(key, time.time())

    async def _on_state(self, msg: Msg) -> None:
        await msg.respond(_encode(self.sharing.state(len(self._by_request), time.time())))

    # --- the request path ------------------------------------------------------------------
    def enter(self, msg: Msg | QueuedMsg) -> Coroutine[Any, Any, None]:
        """The request path; inside a server span when tracing is on (zml_router.tracing)."""
        return rtrace.handle(self, msg) if tracing.ON else self._handle(msg)

    async def _handle(self, msg: Msg | QueuedMsg) -> None:
        t0 = time.monotonic()
        headers = msg.headers or {}
        asked_id = headers.get(subjects.H_REQUEST_ID, "")
        request_id = ""  # set once validated: it goes into subjects, headers and logs
        stream = False
        out = Outcome()
        idclaims.CURRENT.set(None)  # not one inherited from the task that started this one
        plan_limits.CURRENT.set(None)
        try:
            depth = self.cfg.defaults.max_json_depth
            # Validated by the gateway, ZML's fields in headers: one small decode (zmlcore.messages.frontdoor).
            clean = headers.get(subjects.H_BODY) == subjects.BODY_CLEAN
            req = (frontdoor.decode(msg.data, headers, max_depth=depth)
                   if clean else decode_request(msg.data, max_depth=depth))
            stream = req.stream
            request_id = check_request_id(asked_id or req.request_id or _new_id())
            REQUEST_ID.set(request_id)  # on every log line of this request (JSON logs)
            model = self.cfg.resolve_model(req.model)  # once per request: check_fits, the flow, metrics
            if msg.reply and self.nc is not None:  # a reply the requester could not receive: refuse now
                mc = self.cfg.models.get(model)
                check_fits(msg.data, req, headers, self.nc.max_payload, mc.max_model_len if mc else None)
            # The gateway passes the API key's options: its default policy, its cost label. An
            # identity sharing a key's plan gets that key's (its own headers cannot override them).
            owner = subjects.reply_owner(msg.reply)
            shared = self.limits.options(owner)
            if shared is not None:
                headers = {**headers, subjects.H_DEFAULT_POLICY: shared.default_policy, subjects.H_LABEL: shared.label}
            if req.policy is None and req.routing is None and headers.get(subjects.H_DEFAULT_POLICY):
                req.routing = headers[subjects.H_DEFAULT_POLICY]
            out.label = headers.get(subjects.H_LABEL, "")[:200]
            timeout = request_timeout_s(req.timeout_ms, headers.get(subjects.H_TIMEOUT_MS),
                                        self._default_timeout, self.cfg.defaults.max_request_timeout_s)
            task = asyncio.current_task(self.timers.running_loop())  # the loop known: no getpid (3.11)
            assert task is not None
            key = owner_key(msg.reply, headers, request_id)
            keepalive = parse_interval(headers.get(subjects.H_KEEPALIVE))
            held = self._by_request.get(key)
            if held is not None:
                if not headers.get(subjects.H_RESEND):
                    raise DuplicateRequestError(f"request_id {request_id!r} is already in flight for this caller")
                # Sent again because this replica looked dead (stalled): its first attempt
                # answers an inbox nobody reads any more. This one replaces it.
                held.cancel()
            if headers.get(subjects.H_RESEND):
                log.warning("request %s sent again by its requester: the router holding it went silent", request_id)
                self.metrics.taken_over("self" if held is not None else "other")
            self._by_request[key] = task
            if keepalive is not None and msg.reply:
                self.keepalives.add(msg.reply, keepalive, time.monotonic())
                if isinstance(msg, QueuedMsg):  # out of the queue: the requester watches again
                    await self.publish(msg.reply, b"", keepalive_headers())
            lease: Lease | None = None
            try:
                if self.cancelled.take(key, time.time()):  # the cancel overtook the request
                    raise asyncio.CancelledError
                idclaims.CURRENT.set(await self._claim_id(msg, headers, key, req, timeout, request_id))
                if not isinstance(msg, QueuedMsg):  # a queued request was counted when it arrived
                    lease = await self.limits.admit(owner, request_id, timeout)
                    plan_limits.CURRENT.set(lease)
                with self.timers.deadline(timeout):
                    await self._route(msg, req, clean, model, request_id, t0, timeout, out)
            except asyncio.TimeoutError as exc:
                raise flow.deadline_passed(timeout) from exc
            finally:
                if self._by_request.get(key) is task:
                    del self._by_request[key]
                self.keepalives.remove(msg.reply)
                if not out.queued:  # a queued request keeps its claim until it is answered
                    await self.ids.release_current()  # type: ignore[union-attr]
                # Released before any error reply (below); a served request's went before its reply.
                await self.limits.release(lease, (out.info.total_tokens or 0) if out.ok and out.info else 0)
                if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                    msg.placed.set_result(True)
        except asyncio.CancelledError:
            out.error_code = CancelledError.code
            await self.reply_error(msg, CancelledError("request cancelled"), stream)
        except ZMLError as exc:
            out.error_code = exc.code
            await self.reply_error(msg, exc, stream)
        except Exception as exc:  # a bug must not kill the router: answer INTERNAL, log it
            out.error_code = ZMLError.code
            log.exception("internal error on request %s", request_id)
            await self.reply_error(msg, ZMLError(f"internal error: {type(exc).__name__}"), stream)
        self.metrics.finished(out, time.monotonic() - t0)
        if out.model and not out.queued:
            await self._completed(out, request_id, t0)

    async def _claim_id(self, msg: Msg | QueuedMsg, headers: dict[str, str], key: str, req: InferRequest,
                        timeout: float, request_id: str) -> idclaims.Claim | None:
        """The request's claim on its id across replicas: taken here for an id the caller chose,
        carried along by a queued request, none for an id generated by its sender or by us."""
        if isinstance(msg, QueuedMsg):
            return idclaims.queued_claim(key, msg.headers)
        if not (headers.get(subjects.H_REQUEST_ID) or req.request_id) or headers.get(subjects.H_ID_GENERATED) == "1":
            return None
        return await self.ids.claim(key, timeout, request_id,  # type: ignore[union-attr]
                                    takeover=bool(headers.get(subjects.H_RESEND)))

    async def _route(self, msg: Msg | QueuedMsg, req: InferRequest, clean: bool, model: str, request_id: str, t0: float,
                     timeout: float, out: Outcome) -> None:
        """Drive the request's flow (zml_router.flow): each action it yields, done here."""
        out.model, out.op = model, req.kind()
        policy, rr = flow.prepare(self.cfg, self.table.families(), req, msg.data, model)
        bodies = NodeBodies(msg.data, req.model, clean)
        cfg = policy.config
        can_queue = bool(cfg.queue_on_saturation and self.queue is not None and msg.reply)
        from_queue = isinstance(msg, QueuedMsg)
        plan = flow.Plan(model, policy.name, rr, self.cfg.router.max_attempts, req.stream, can_queue,
                         can_queue and not from_queue and self.queue.has_waiting(model),  # type: ignore[union-attr]
                         from_queue)
        steps = flow.route(plan, out)
        result: flow.Result = None
        while True:
            try:
                action = steps.send(result)
            except StopIteration:
                return
            if type(action) is flow.Decide:
                try:
                    result = self.metrics.decide(self.admission.decide, action.rr, policy)
                except ZMLError as exc:
                    result = exc
            elif type(action) is flow.Dispatch:
                result = await self._attempt(msg, req, bodies, model, action, request_id, t0, out)
            elif type(action) is flow.Penalise:
                await self._penalise(action)
                result = None
            else:  # Enqueue: the flow is over
                assert type(action) is flow.Enqueue
                put = self.glue.saturated if action.saturated else self.glue.enqueue
                await put(msg, req, model, request_id, cfg.max_queue_ms, timeout)
                return

    async def _attempt(self, msg: Msg | QueuedMsg, req: InferRequest, bodies: NodeBodies, model: str, action: flow.Dispatch,
                       request_id: str, t0: float, out: Outcome) -> AttemptError | None:
        """One attempt on the decided node: None once the answer is out, else how it failed."""
        decision = action.decision
        view = self.table.views[decision.node_id]
        info = RoutingInfo(
            node_id=decision.node_id, accelerator_type=view.state.accelerator_type, family=decision.family,
            policy=decision.policy, queue_depth_at_dispatch=decision.queue_depth, decision_id=_decision_id(),
            request_id=request_id, attempts=action.attempt, router_id=self.router_id, label=out.label,
        )
        out.info = info
        DECISION_ID.set(info.decision_id)
        served = view.state.served_names.get(model)
        node_body = bodies(served or model)
        first_byte = self.relay.first_byte_s(decision.node_id, req, action.rr)
        # The engine answers with its own name: the client gets back the name it asked for.
        rename = Renamer(served, req.model) if served and served != req.model else None
        try:
            if action.stream:
                await self.relay.stream(msg, req, node_body, info, t0, first_byte, rename)
            else:
                await self.relay.once(msg, req, node_body, info, t0, first_byte, rename)
        except AttemptError as err:
            self.metrics.failover(decision.node_id, err.failure.value)
            return err
        return None

    async def _penalise(self, action: flow.Penalise) -> None:
        """Skip a node that failed or refused, here and (over NATS) on every replica."""
        err = action.error
        rc = self.cfg.router
        how = flow.penalty(err, rc.saturated_s, rc.cooldown_s)
        if how is not None:
            await self.sharing.mark(action.decision.node_id, how[0], how[1],
                                    "mid_stream" if err.mid_stream else err.failure.value)

    async def _completed(self, out: Outcome, request_id: str, t0: float) -> None:
        """One event per finished request (warmup measures demand, health counts node errors)."""
        if self.events is not None:  # sent off the request path, with the others of the next ms
            ev = flow.completion(out, request_id, time.time(), time.monotonic() - t0, self.router_id)
            self.events.add(completed_encoder.encode(ev))

    # --- replies -------------------------------------------------------------------------------
    async def publish(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        if reply and self.pub is not None:
            await self.pub.publish(reply, data, headers=headers)
            if self.keepalives:  # the next keepalive is an interval after this message
                self.keepalives.sent(reply, time.monotonic())

    async def before_last_reply(self, tokens: int) -> None:
        """Free what the caller may reuse the moment it has the last reply: the request id's
        claim and the plan's concurrency slot (on every replica: zml_router.limits)."""
        await self.ids.release_current()  # type: ignore[union-attr]
        await self.limits.release_current(tokens)

    async def reply_error(self, msg: Msg | QueuedMsg, exc: ZMLError, stream: bool) -> None:
        headers = {subjects.H_ERROR_CODE: exc.code, **getattr(exc, "nats_headers", {})}
        if exc.retry_after is not None:
            headers[subjects.H_RETRY_AFTER] = f"{exc.retry_after:g}"
        if stream:
            headers[subjects.H_STREAM] = subjects.STREAM_ERROR
        try:
            if self.ids is not None:
                await self.ids.release_current()
            await self.publish(msg.reply, _encode(exc.to_body()), headers)
        except Exception:  # connection closing: the requester times out on its side
            log.warning("could not send error reply %s", exc.code)
