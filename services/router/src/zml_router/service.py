"""The router: takes requests from ``zml.infer`` (queue group), decides, dispatches, replies.

This module is the outline: lifecycle, subscriptions, and the I/O that carries out each
request's sans-I/O steps (``zml_router.request``: intake -> prepare -> route: decide, dispatch, fail
over, queue, answer). The parts live beside it, each given what it uses: one attempt on a node
and every reply to the requester (``relay``, its pure half ``attempt``), in-flight counts and
marks shared with the other replicas (``inflight``), the saturation queue's glue
(``saturation``, over ``queue``), ids claimed across replicas (``ids``), plan limits
(``limits``), metrics and spans (``metrics``, ``tracing``). Which node serves is policy:
``zmlcore.policy.admit`` on the router's table (``table``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.bus.batchpub import BatchPublisher
from zmlcore.bus.direct import subscribe_direct
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.config import ZMLConfig
from zmlcore.fleet.catalog import unserved
from zmlcore.errors import CancelledError, DuplicateRequestError, QueueFullError, ZMLError
from zmlcore.runtime.bytebudget import ByteBudget
from zmlcore.messages import frontdoor
from zmlcore.messages.audio import AudioRequest
from zmlcore.messages import decision_query_decoder
from zmlcore.messages.warmup import completed_encoder
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest, RoutingState, admit
from zmlcore.flowctl.slo import Pairs, queue_budget_s
from zmlcore.policy.headroom import admit_batch
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.reply.keepalive import KeepaliveBook, keepalive_headers
from zmlcore.runtime.runner import cancel_and_wait
from zmlcore.telemetry import tracing
from zmlcore.telemetry.setup import REQUEST_ID
from zml_router.request import finish, intake, prepare, route
from zml_router.replicas import ids as idclaims
from zml_router.replicas import limits as plan_limits
from zml_router.telemetry import tracing as rtrace
from zml_router.node.attempt import AudioBodies, NodeBodies
from zml_router.request.cancels import CancelBook
from zml_router.replicas.cooldowns import Marks
from zml_router.node.dispatch import NodeClient
from zml_router.node.result import Close, Dispatch
from zml_router.request.split import Splitter
from zml_router.outcome import Outcome
from zml_router.request.intake import Intake
from zml_router.replicas.ids import RequestIds
from zml_router.replicas.inflight import Sharing
from zml_router.answer.keepalives import send_keepalives
from zml_router.replicas.limits import IdentityLimits, Lease
from zml_router.telemetry.metrics import RouterMetrics
from zml_router.replicas.prefixshare import PrefixShare
from zml_router.incoming import QueuedMsg, Uploaded
from zml_router.answer.record import resumed_from
from zml_router.answer.replies import Replies
from zml_router.node.relay import Relay
from zml_router.queue.glue import QueueGlue
from zml_router.queue.jetstream import H_ENQUEUED
from zml_router.request.flowgate import FlowGate, Note, targets
from zml_router.replicas.shares import ShareSync
from zml_router.replicas.sessions import Sessions, session_key
from zml_router.replicas.table import NodeTable
from zml_router.timers import Wheel
from zml_router.request.uploads import Uploads, upload_size

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode
_EVENT_COMPLETED = subjects.event(subjects.EVENT_COMPLETED)
#: Completion events wait this long for others to go out with (health and warmup aggregate
#: them over seconds; one wake-up per batch instead of per request for every subscriber).
COMPLETED_WINDOW_S = 0.01


class RouterService:
    def __init__(self, cfg: ZMLConfig, router_id: str | None = None) -> None:
        self.cfg = cfg
        self.router_id = router_id or f"router-{os.urandom(3).hex()}"
        self.table = NodeTable(cfg.families())
        self.marks = Marks(self.table, self.router_id)
        self.state = RoutingState()
        self.sharing = Sharing(self.table, self.marks, self.router_id)
        self.nc: NATS | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: In-flight requests by (owner, front-door owner, request id): ids are scoped to owners.
        self.in_flight: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []
        #: Cancelled requests (by owner key) not held here (not arrived yet, or waiting in the queue).
        self.cancelled = CancelBook()
        #: Plans of NATS client identities (zml creds issue NAME --plan ...): zml_router.replicas.limits.
        self.limits = IdentityLimits()
        #: Requests whose requester asked for keepalives (zmlcore.reply.keepalive), by reply subject.
        self.keepalives = KeepaliveBook()
        #: Callers' request ids in flight on every replica (zml_router.replicas.ids).
        #: this process among the routers that ever ran as router_id (RouterState.incarnation)
        self.incarnation = os.urandom(4).hex()
        self.ids = RequestIds(self.router_id, cfg.defaults.max_request_timeout_s, self.incarnation)
        #: Completion events, published together every few ms (zmlcore.bus.batchpub).
        self.events: BatchPublisher | None = None
        #: Request and first-byte deadlines: one timer wheel, not a loop timer each (zml_router.timers).
        self.timers = Wheel()
        self.metrics = RouterMetrics(cfg, self.table, self.in_flight)
        self.replies = Replies(self.keepalives, self.ids, self.limits)
        self.http = NodeClient(cfg.router.max_connections, cfg.router.connect_timeout_s)
        #: Bodies larger than one message, asked of their requesters (zml_router.request.uploads).
        self.uploads = Uploads(self.router_id)
        #: Audio bytes this router holds at once ([defaults] audio_bytes_in_flight).
        self.audio_bytes = ByteBudget(cfg.defaults.audio_bytes_in_flight)
        #: Which prompt prefixes each node holds (zmlcore.policy.prefix), shared with the other
        #: replicas and fed by the engines' reports and KV events (zml_router.replicas.prefixshare).
        self.prefix = PrefixIndex()
        self.share: PrefixShare | None = None
        #: Session -> node bindings, shared in the KV bucket zml_sessions (zml_router.replicas.sessions).
        self.sessions: Sessions | None = None
        self.metrics.prefix = self.prefix
        self.relay = Relay(cfg, self.router_id, self.table, self.sharing, self.timers, self.http, self.metrics,
                           self.replies, self._corrected)
        #: Prefill on one node, decode on another, per request ([disaggregation]: zml_router.request.split).
        self.splitter = Splitter(cfg, self.table)
        #: Flow control: bands, tenants' fair shares, SLO admission (zml_router.request.flowgate),
        #: the shares kept in step with the other replicas (zml_router.replicas.shares).
        self.gate = FlowGate(cfg, self.table, self.state, self.prefix, self.router_id)
        self.shares: ShareSync | None = None
        self.glue = QueueGlue(cfg, self.table, self.queued_admit, self.metrics, self.replies, self.cancelled,
                              self.ids, self.enter, self.spawn, self.gate)
        # Bound once: the request path calls them per request.
        self._admit = self.admit
        self._options = self.limits.options

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.replies.start(nc)  # replies and stream chunks: one write per loop iteration
        self.events = BatchPublisher(nc, _EVENT_COMPLETED, COMPLETED_WINDOW_S)
        self.events.start()
        if self.cfg.router.stale_after_s < 2 * self.cfg.health.poll_interval_s:
            log.warning("[router] stale_after_s (%g s) is under two health polls (%g s each): nodes will "
                        "flap to stale between polls", self.cfg.router.stale_after_s, self.cfg.health.poll_interval_s)
        # Followers re-create their watch (and re-read the snapshot) after every reconnect.
        # A node a re-watch's snapshot lacks (no delete marker) ages out like one health stopped
        # updating, instead of vanishing from routing at once (zmlcore.bus.kvfollow says when).
        stale_s = self.cfg.router.stale_after_s
        self.share = PrefixShare(nc, self.router_id, self.prefix)
        await self.share.start()
        self.sessions = Sessions(nc, idle_s=self.cfg.router.session_idle_s)
        await self.sessions.start()
        self.shares = ShareSync(nc, self.gate.book, self.cfg.flow.share_report_ms / 1000.0)
        await self.shares.start()
        self.nodes_follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=self._node_put,
                                         on_delete=self._node_delete,
                                         keep_vanished=lambda key: self.table.fresh_for(key, stale_s, time.time()))
        self._loops.append(asyncio.create_task(self.nodes_follower.run()))
        self._loops.append(asyncio.create_task(self.table.costs.follower(nc).run()))
        # A snapshot before taking traffic; an empty bucket has nothing to wait for.
        await self.nodes_follower.wait_ready(2.0)
        await self.limits.start(nc)
        await self.ids.open(nc)
        queue = await self.glue.start(nc, self.router_id)
        self.table.on_change = self.gate.freed = queue.capacity.set
        self.gate.waiting = queue.waiting
        self.sharing.peer_freed = self.gate.peer_freed
        self.sharing.peers_gone = self.gate.peers_gone
        self._subs += await self.sharing.start(nc, queue.capacity.set)
        self._loops.append(asyncio.create_task(self.sharing.publish_snapshots()))
        self._loops.append(asyncio.create_task(send_keepalives(self.keepalives, nc)))
        self.metrics.start(nc)
        await self.uploads.start(nc)
        self._subs.append(await nc.subscribe(f"{subjects.CANCEL_PREFIX}.>", cb=self._on_cancel))
        self._subs.append(await nc.subscribe(subjects.router_state(self.router_id), cb=self._on_state))
        self._subs.append(await nc.subscribe(subjects.ROUTERS_STATE, cb=self._on_state))
        self._subs.append(await nc.subscribe(subjects.ROUTERS_DECISION, cb=self._on_decision))
        for subject in (subjects.INFER, subjects.FRONT_DOOR_INFER):  # each request a task of its own at once
            self._subs.append(await subscribe_direct(nc, subject, self._on_request, queue=subjects.ROUTER_QUEUE))

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
        if self.glue.queue is not None:
            await self.glue.queue.stop()
        await cancel_and_wait(self._loops)
        self.timers.close()
        if self.events is not None:
            await self.events.stop()
        self.sharing.close()
        if self.share is not None:
            await self.share.stop()
        if self.sessions is not None:
            await self.sessions.stop()
        if self.shares is not None:
            await self.shares.stop()
        await self.metrics.stop()
        await self.limits.stop()
        await self.uploads.stop()
        await self.http.aclose()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task the router waits for (bounded) when it stops."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def admit(self, rr: RouteRequest, policy: ResolvedPolicy) -> Decision:
        """The decision for a request on this router's table (zmlcore.policy.admission), each
        node's estimate counting only the prompt tokens its prefix cache does not hold."""
        rc = self.cfg.router
        return admit(self.table.nodes(), rr, policy, time.time(), self.state,
                     stale_after_s=rc.stale_after_s, ttft_bound_s=rc.admission_ttft_s, cache=self.prefix)

    # --- the node table and the prefix index follow the node bucket -------------------------
    def _node_put(self, key: str, value: bytes) -> None:
        self.table.put_raw(key, value)
        view = self.table.views.get(key)
        if view is not None:  # each node's index is sized from what its engine reports
            self.prefix.update_node(view.state)

    def _node_delete(self, key: str) -> None:
        self.table.delete_raw(key)
        self.prefix.forget_node(key)

    def _corrected(self, node_id: str, rr: RouteRequest, cached: int, prompt_tokens: int) -> None:
        """The engine reported ``cached`` of the prompt's tokens cached (relay, on its reply)."""
        if self.share is not None:
            self.share.corrected(node_id, rr.prefix, cached, prompt_tokens, time.time())

    def queued_admit(self, rr: RouteRequest, policy: ResolvedPolicy, headers: dict[str, str], ahead: int = 0) -> Decision:
        """The decision for a queued request (the queue asks whether it has room): through the
        flow gate with the band, tenant and targets it was queued with, ``ahead`` entries ranked
        before it."""
        note = self.gate.note(subjects.INFER, "", headers, rr.model)
        if note is None:
            return self.admit(rr, policy)
        return self.gate.decide(rr, policy, note, True, ahead=ahead)

    def admit_batch(self, rr: RouteRequest, policy: ResolvedPolicy) -> Decision:
        """A batch-priority request (``Zml-Priority: batch``): only where a node has headroom
        beyond what interactive traffic needs, else QUEUE_FULL at once (zmlcore.policy.headroom)."""
        rc = self.cfg.router
        return admit_batch(self.table.nodes(), rr, policy, time.time(), self.state,
                           stale_after_s=rc.stale_after_s, reserve=rc.batch_reserve)

    # --- subscriptions ---------------------------------------------------------------------
    def _on_request(self, msg: Msg) -> None:
        # In nats-py's reader (zmlcore.bus.direct): the request's task is started there, not
        # from a callback subscription's task woken per message (a task switch per request).
        self.spawn(self.enter(msg))

    async def _on_cancel(self, msg: Msg) -> None:
        task = intake.cancel(msg.subject, msg.headers, self.in_flight, self.cancelled, time.time())
        if task is not None:
            task.cancel()

    async def _on_state(self, msg: Msg) -> None:
        state = self.sharing.state(len(self.in_flight), time.time())
        state.incarnation = self.incarnation
        await msg.respond(_encode(state))

    async def _on_decision(self, msg: Msg) -> None:
        """Answer only when this replica made the decision: the asker takes the first answer,
        and silence from every replica means none remembers it."""
        try:
            did = decision_query_decoder.decode(msg.data).decision_id
        except msgspec.ValidationError:
            return
        record = self.relay.decisions.record(did)
        if record is not None and msg.reply:
            await msg.respond(_encode(record))

    # --- the request path ------------------------------------------------------------------
    def enter(self, msg: Msg | QueuedMsg) -> Coroutine[Any, Any, None]:
        """The request path; inside a server span when tracing is on (zml_router.telemetry.tracing)."""
        return rtrace.handle(self.router_id, msg, self._handle) if tracing.ON else self._handle(msg)

    async def _handle(self, msg: Msg | QueuedMsg | Uploaded) -> None:
        t0 = time.monotonic()
        out = Outcome()
        from_queue = isinstance(msg, QueuedMsg)
        idclaims.CURRENT.set(None)  # not one inherited from the task that started this one
        plan_limits.CURRENT.set(None)
        held = 0  # audio bytes this request holds ([defaults] audio_bytes_in_flight)
        try:
            h = msg.headers
            if h and (subjects.H_AUDIO in h or subjects.H_UPLOAD_BYTES in h):  # two lookups, not an await, per request
                held, msg = await self._audio_body(msg, from_queue)
            nc = self.nc
            max_payload = nc.max_payload if msg.reply and nc is not None else None  # a reply to check it fits
            arrived: Intake[asyncio.Task[None]] = intake.intake(
                msg, from_queue=from_queue, cfg=self.cfg, max_payload=max_payload, options=self._options,
                in_flight=self.in_flight, cancels=self.cancelled, now=time.time(), out=out)
            REQUEST_ID.set(arrived.request_id)  # on every log line of this request (JSON logs)
            task = asyncio.current_task(self.timers.running_loop())  # the loop known: no getpid (3.11)
            assert task is not None
            if arrived.replaces is not None:
                arrived.replaces.cancel()
            if arrived.taken_over:
                log.warning("request %s sent again by its requester (its router went silent, a broker blink or a "
                            "lost message)%s",
                            arrived.request_id, "" if arrived.resume is None else
                            f"; continuing its stream after {arrived.resume.tokens} chunks")
                self.metrics.taken_over(arrived.taken_over)
            key = arrived.key
            if not arrived.claim:  # one with an id to claim across replicas: once it is its (_holds)
                self.in_flight[key] = task
            if arrived.keepalive is not None and msg.reply:
                self.keepalives.add(msg.reply, arrived.keepalive, time.monotonic())
                if from_queue:  # out of the queue: the requester watches again
                    await self.replies.publish(msg.reply, b"", keepalive_headers())
            lease: Lease | None = None
            try:
                if arrived.cancelled:  # the cancel overtook the request
                    raise asyncio.CancelledError
                # The request's claim on its id across replicas: carried along by a queued request.
                if isinstance(msg, QueuedMsg):
                    idclaims.CURRENT.set(idclaims.queued_claim(key, msg.headers))
                elif arrived.claim:
                    idclaims.CURRENT.set(await self.ids.claim(key, arrived.timeout, arrived.request_id,
                                                              takeover=arrived.resend))
                    self._holds(key, task, arrived)
                if not from_queue:  # a queued request was counted when it arrived
                    lease = await self.limits.admit(arrived.owner, arrived.request_id, arrived.timeout)
                    plan_limits.CURRENT.set(lease)
                with self.timers.deadline(arrived.timeout):
                    await self._route(msg, arrived, t0, out)
            except asyncio.TimeoutError as exc:
                raise finish.deadline_passed(arrived.timeout) from exc
            finally:
                if self.in_flight.get(key) is task:
                    del self.in_flight[key]
                # A queued request let go of its keepalives when it was handed over (_hand_over:
                # the attempt out of the queue may have taken them up again by now), and keeps its
                # claim until it is answered.
                if not out.queued:
                    self.keepalives.remove(msg.reply)
                    await self.ids.release_current()
                # Released before any error reply (below); a served request's went before its reply.
                await self.limits.release(lease, (out.info.total_tokens or 0) if out.ok and out.info else 0)
                if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                    msg.placed.set_result(True)
        except asyncio.CancelledError:
            out.error_code = CancelledError.code
            await self.replies.error(msg, CancelledError("request cancelled"), out.stream)
        except ZMLError as exc:
            out.error_code = exc.code
            await self.replies.error(msg, exc, out.stream)
        except Exception as exc:  # a bug must not kill the router: answer INTERNAL, log it
            out.error_code = ZMLError.code
            log.exception("internal error on request %s", out.request_id)
            await self.replies.error(msg, ZMLError(f"internal error: {type(exc).__name__}"), out.stream)
        finally:
            self.audio_bytes.give(held)
        self.metrics.finished(out, time.monotonic() - t0)
        if out.flow is not None and out.ok:  # the tenant's real cost; the node's TPOT learned
            self.gate.finished(out.flow, out.completion_tokens,
                               out.info.time_to_first_token if out.info is not None else None, time.monotonic() - t0)
        if out.model and not out.queued and self.events is not None:
            # One event per finished request (warmup measures demand, health counts node
            # errors), sent off the request path with the others of the next ms.
            ev = finish.completion(out, time.time(), time.monotonic() - t0, self.router_id)
            self.events.add(completed_encoder.encode(ev))

    async def _audio_body(self, msg: Msg | QueuedMsg | Uploaded, from_queue: bool) -> tuple[int, Any]:
        """An audio request's bytes counted against [defaults] audio_bytes_in_flight (QUEUE_FULL
        past it), and a body announced in parts fetched from its requester (zml_router.request.uploads).
        Returns (bytes held, the message with its body)."""
        headers = msg.headers or {}
        limit = self.cfg.defaults.max_audio_bytes if subjects.H_AUDIO in headers else self.cfg.gateway.max_body_bytes
        size = None if from_queue else upload_size(headers, limit)
        if size is None and subjects.H_AUDIO not in headers:
            return 0, msg
        held = size if size is not None else len(msg.data)
        if not self.audio_bytes.take(held):
            raise QueueFullError(f"this router holds {self.audio_bytes.held} bytes of audio, its limit "
                                 "([defaults] audio_bytes_in_flight): retry shortly", retry_after=1.0)
        if size is None:
            return held, msg
        try:
            body = await self.uploads.collect(msg.reply, size, self.cfg.defaults.request_timeout_s)
        except BaseException:
            self.audio_bytes.give(held)
            raise
        return held, Uploaded(msg.subject, body, msg.reply, msg.headers)

    async def _route(self, msg: Msg | QueuedMsg | Uploaded, arrived: Intake[asyncio.Task[None]], t0: float, out: Outcome) -> None:
        """Drive the request's flow (zml_router.request): each action it yields, done here."""
        req, model = arrived.req, arrived.model
        out.model, out.op = model, req.kind()
        session = prepare.session_of(msg.headers, req)
        skey = (session_key(prepare.session_owner(arrived.owner, msg.headers), session)
                if session and self.sessions is not None else "")
        bound = self.sessions.node(skey) if skey and self.sessions is not None else None
        policy, rr = prepare.prepare(self.cfg, self.table.families(), req, msg.data, model, bound, msg.headers)
        if rr.accelerator_id is not None and self.table.pin_unsure(rr.accelerator_id, model):
            # `zml nodes` may show what our watch has not delivered yet (a node added just now)
            await self.nodes_follower.refresh(rr.accelerator_id)
        bodies = (AudioBodies(msg.data, req.form) if isinstance(req, AudioRequest) and req.form is not None
                  else NodeBodies(msg.data, req.model, arrived.clean))
        cfg = policy.config
        queue = self.glue.queue
        # Batch work waits in its runner, not in the saturation queue (which admits without headroom).
        batch = (msg.headers or {}).get(subjects.H_PRIORITY) == subjects.PRIORITY_BATCH
        # A body that came in parts would not fit in the queue's one message.
        can_queue = bool(cfg.queue_on_saturation and queue is not None and msg.reply and not batch
                         and not isinstance(msg, Uploaded))
        from_queue = isinstance(msg, QueuedMsg)
        note = None if batch else self.gate.note(msg.subject, arrived.owner, msg.headers, model)
        decide = self._admit
        if note is not None:  # flow control: band, tenant share, SLO (zml_router.request.flowgate)
            out.flow = note
            if from_queue:
                enq = (msg.headers or {}).get(H_ENQUEUED)
                note.queued_ms = int((time.time() - float(enq)) * 1000) if enq else None

            ahead = msg.ahead if isinstance(msg, QueuedMsg) else 0

            def decide(rr: RouteRequest, policy: ResolvedPolicy, pairs: Pairs | None = None) -> Decision:
                return self.gate.decide(rr, policy, note, from_queue, pairs, ahead=ahead)
        answer = self.relay.answer(req, msg.data, model)  # what the requester gets, across attempts
        resumed = None
        if arrived.resume is not None:  # its router died mid-stream: continue what the requester has
            resumed = answer.resume(arrived.resume)
            out.continued_from = resumed_from(arrived.resume)
            can_queue = False  # a stream in progress does not wait behind others
        plan = route.Plan(model, policy.name, rr, self.cfg.router.max_attempts, req.stream, can_queue,
                         can_queue and not from_queue and queue.has_waiting(model)  # type: ignore[union-attr]
                         and not self._outranks(note, model),
                         from_queue, msg.data, frontdoor.continue_asked(req, msg.headers), cfg.continue_on_failure,
                         resumed, arrived.resume.attempts if arrived.resume is not None else 0,
                         usage_asked=answer.usage_asked)
        steps = route.route(plan, out)
        result: route.Result = None
        while True:
            try:
                action = steps.send(result)
            except StopIteration:
                return
            if type(action) is route.Decide and action.refill is not None:
                # a split's prefill leg failed: another prefill node for its decode node, or whole there
                ttft_t, tpot_t = targets(note)
                result, why = self.splitter.decide(action.refill, action.rr, policy, time.time(), skey,
                                                   decode_node=action.refill.node_id,
                                                   no_room=self.gate.no_room(note, model),
                                                   tpot_target_s=tpot_t, ttft_target_s=ttft_t)
                self.metrics.split("split" if result.prefill_node else why)
            elif type(action) is route.Decide:
                rr = action.rr
                if action.continuation:  # only a node whose engine can continue the answer
                    rr = dataclasses.replace(rr, exclude=rr.exclude | self.table.cannot_continue())
                may_split = (action.split and self.splitter.enabled and not batch and rr.accelerator_id is None
                             and isinstance(bodies, NodeBodies) and req.kind() in ("chat", "completion"))
                try:
                    if may_split and note is not None and note.ask.slo is not None:
                        # with targets no whole node meets, SLO admission looks for a pair before refusing
                        result = self.metrics.decide(decide, rr, policy, self.splitter.pairs(rr.model, time.time()))
                    else:
                        result = self.metrics.decide(self.admit_batch if batch else decide, rr, policy)
                except ZMLError as exc:
                    result = unserved(exc, rr.model, self.cfg.model_names(), self.table.raw.values())
                if may_split and isinstance(result, Decision) and result.prefill_node:
                    self.splitter.admitted(skey)  # split by SLO admission: only a pair meets its targets
                    self.metrics.split("split")
                elif may_split and isinstance(result, Decision):
                    ttft_t, tpot_t = targets(note)
                    result, why = self.splitter.decide(result, rr, policy, time.time(), skey,
                                                       no_room=self.gate.no_room(note, model), tpot_target_s=tpot_t,
                                                       ttft_target_s=ttft_t)
                    self.metrics.split("split" if result.prefill_node else why)
                    if result.prefill_node:
                        self.gate.redirected(note, result, rr.model)
            elif type(action) is Dispatch:
                node_id = action.decision.node_id
                if note is not None:
                    self.gate.sent(node_id, note)
                    if not note.charged:
                        self.gate.dispatched(note, action.rr.prompt_tokens)
                if self.share is not None:  # the node will hold this prompt: every replica learns it
                    self.share.recorded(node_id, action.rr.prefix, time.time())
                if skey and self.sessions is not None and action.rr.accelerator_id is None:
                    self.sessions.bind(skey, node_id)
                self.metrics.session(action.decision.session)
                try:
                    result = await self.relay.attempt(msg, req, bodies, model, action, arrived.request_id, t0, out,
                                                      answer)
                finally:
                    if note is not None:
                        self.gate.ended(note)
            elif type(action) is route.Prefill:
                assert isinstance(bodies, NodeBodies)
                result = await self.relay.prefill(req, bodies, model, action, arrived.request_id, out)
            elif type(action) is route.Penalise:
                await self._penalise(action)
                result = None
            elif type(action) is Close:
                result = await self.relay.close(msg, req, answer, arrived.request_id, action, out.label, out.info)
            else:  # Enqueue: the flow is over
                assert type(action) is route.Enqueue
                self._hand_over(arrived.key, msg.reply)
                put = self.glue.saturated if action.saturated else self.glue.enqueue
                tenant, budget = "", None
                if note is not None:
                    tenant = note.ask.tenant
                    if note.ask.slo is not None:
                        budget = queue_budget_s(self.table.nodes(), rr, note.ask.slo, time.time(),
                                                self.cfg.router.stale_after_s)
                await put(msg, req, model, arrived.request_id, cfg.max_queue_ms, arrived.timeout, tenant, budget)
                return

    def _holds(self, key: str, task: asyncio.Task[None], arrived: Intake[asyncio.Task[None]]) -> None:
        """A request whose id its caller chose is in flight here once the bucket has let it claim
        the id (zml_router.replicas.ids), not while it asks: a duplicate waiting for the bucket's
        verdict (a round trip or two, and a ping of the holder) must not stand in ``in_flight``
        where the id's holder meets it. That holder may be the request waiting in the saturation
        queue, whose claim travels with it: out of the queue on this replica during a duplicate's
        claim, it met the duplicate here and answered DUPLICATE_REQUEST_ID to its own requester.
        Checked again now for what the claim let through while this one asked (a bucket out of
        reach claims nothing), and for a cancel that came meanwhile (it found nothing in flight)."""
        if not arrived.resend and key in self.in_flight:
            raise DuplicateRequestError(f"request_id {arrived.request_id!r} is already in flight for this caller")
        if self.cancelled.take(key, time.time()):
            raise asyncio.CancelledError
        self.in_flight[key] = task

    def _outranks(self, note: Note | None, model: str) -> bool:
        """Does a new request rank before everything waiting in the saturation queue for
        ``model`` (flow control: a higher band, or its tenant under its share while only
        over-share work waits)? Then it takes a free slot at once instead of a trip through the
        queue (~20 ms on a loaded box) to the head it would reach anyway; with none free it
        queues as any request does, first in the order."""
        if note is None or self.glue.queue is None:
            return False
        return self.gate.outranks(note, self.glue.queue.best_waiting(model))

    def _hand_over(self, key: str, reply: str) -> None:
        """The request goes to the saturation queue: this attempt no longer holds it (its claim on
        its id does, zml_router.replicas.ids). Let go of its slot in ``in_flight`` (and its keepalives)
        before the queue entry exists: this router's own queue worker can take the entry, find
        room and start it before the publish's ack is back here, and that attempt must not meet
        this one in ``in_flight`` (DUPLICATE_REQUEST_ID to its own requester). A cancel arriving
        from now on is remembered for the queue (zml_router.request.cancels), as for any queued request."""
        if self.in_flight.get(key) is asyncio.current_task():
            del self.in_flight[key]
        self.keepalives.remove(reply)

    async def _penalise(self, action: route.Penalise) -> None:
        """Skip a node that failed or refused, here and (over NATS) on every replica."""
        err = action.error
        rc = self.cfg.router
        how = finish.penalty(err, rc.saturated_s, rc.cooldown_s)
        if how is not None:
            await self.sharing.mark(action.decision.node_id, how[0], how[1],
                                    "mid_stream" if err.mid_stream else err.failure.value)
