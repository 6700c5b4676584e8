"""The router: takes requests from ``zml.infer`` (queue group), decides, dispatches, replies.

Per request: decode -> resolve policy -> choose_node on the local table (no network) ->
count it in flight -> HTTP to the node -> reply (one message, or start/chunk.../end).
A node that fails before the first token is excluded and the decision re-run.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects, tracing
from zmlcore.config import ZMLConfig
from zmlcore.errors import (
    BackendError,
    BadRequestError,
    CancelledError,
    DuplicateRequestError,
    ModelNotLoadedError,
    NoHealthyNodesError,
    QueueFullError,
    TimeoutError,
    ZMLError,
)
from zmlcore.messages.warmup import RequestCompleted, completed_encoder
from zmlcore.messages import (
    ZML_REQUEST_KEYS,
    InferRequest,
    InflightDelta,
    InflightSnapshot,
    RoutingInfo,
    StreamStart,
    infer_request_decoder,
    node_mark_decoder,
)
from zmlcore.keepalive import QUEUED, KeepaliveBook, keepalive_headers, parse_interval
from zmlcore.kvfollow import KVFollower
from zmlcore.runner import cancel_and_wait
from zmlcore.batchpub import BatchPublisher
from zmlcore.bigreply import accepted, check_fits
from zmlcore.replyparts import publish_reply
from zmlcore.telemetry import DECISION_ID, REQUEST_ID
from zmlcore.validate import check_request_id, decode_request, request_timeout_s
from zmlcore.policy import (
    Decision,
    ResolvedPolicy,
    RouteRequest,
    RoutingState,
    choose_node,
    is_routable,
    resolve_policy,
)
from zmlcore.policy.resolve import builtin_policy
from zml_router.cancels import CancelBook
from zml_router import tracing as rtrace
from zml_router.metrics import RouterMetrics
from zml_router.cooldowns import Marks
from zml_router.dispatch import (
    AttemptError,
    Failure,
    NodeClient,
    first_chunk_within,
    post_json,
    stream_sse,
    stream_usage,
    within_first_byte,
)
from zml_router.firstbyte import expected_s, first_byte_timeout
from zml_router.keepalives import send_keepalives
from zml_router import ids as idclaims
from zml_router.ids import RequestIds, claim_key
from zml_router.kinds import PATHS, check_kind
from zml_router.limits import IdentityLimits, Lease
from zml_router.rename import Renamer
from zml_router.queue import H_DEADLINE, H_ENQUEUED, H_QUEUED_HEADERS, H_TOTAL_MS, QueuedMsg, SaturationQueue
from zml_router.table import NodeTable
from zml_router.trust import front_door_headers

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode
_decode_any = msgspec.json.Decoder()
_delta_decoder = msgspec.json.Decoder(InflightDelta)
_snapshot_decoder = msgspec.json.Decoder(InflightSnapshot)
SNAPSHOT_EVERY_S = 1.0
#: A queued head is acknowledged once its node has not refused it within this long.
PLACEMENT_WAIT_S = 0.5

_LATENCY = builtin_policy("latency")
_ZML_KEYS_BYTES = tuple(f'"{k}"'.encode() for k in ZML_REQUEST_KEYS)
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def _with_routing(raw: bytes, info: RoutingInfo) -> bytes:
    """The node's JSON object with ``"zml": {...}`` appended, without re-encoding the body."""
    m = _TOTAL_TOKENS.search(raw)
    if m:
        info.total_tokens = int(m.group(1))
    body = raw.rstrip()
    if body[:1] == b"{" and body[-1:] == b"}":
        sep = b"," if body[1:-1].strip() else b""
        return body[:-1] + sep + b'"zml":' + _encode(info) + b"}"
    raise AttemptError(Failure.SERVER, 200, f"node answered a non-object JSON body: {raw[:100]!r}")




class _Outcome:
    """What happened to one request, for its completion event."""

    __slots__ = ("model", "node_id", "family", "ok", "error_code", "node_error", "failed_nodes",
                 "attempts", "info", "queued", "slow_nodes", "label", "op")

    def __init__(self) -> None:
        self.model = ""
        self.op = ""  # chat | completion
        self.node_id = ""
        self.family = ""
        self.ok = False
        self.error_code = ""
        self.node_error = False
        self.failed_nodes: list[str] = []
        self.slow_nodes: list[str] = []
        self.attempts = 0
        self.info: RoutingInfo | None = None
        self.queued = False  # parked in the saturation queue: its event comes when it is served
        self.label = ""  # the API key's cost-attribution label (gateway header)


_EVENT_COMPLETED = subjects.event(subjects.EVENT_COMPLETED)
#: Completion events wait this long for others to go out with (health and warmup aggregate
#: them over seconds; one wake-up per batch instead of per request for every subscriber).
COMPLETED_WINDOW_S = 0.01


def _new_id() -> str:
    return os.urandom(8).hex()


def _owner_key(reply: str, headers: dict[str, str], request_id: str) -> str:
    """Whose request id this is: the identity owning the reply inbox, narrowed by a front
    door's ``Zml-Owner`` (which can only split the sender's own namespace further)."""
    return claim_key(subjects.reply_owner(reply), headers.get(subjects.H_OWNER, ""), request_id)


class RouterService:
    def __init__(self, cfg: ZMLConfig, router_id: str | None = None) -> None:
        self.cfg = cfg
        self.router_id = router_id or f"router-{_new_id()[:6]}"
        self.table = NodeTable(cfg.families())
        self.marks = Marks(self.table, self.router_id)
        self.state = RoutingState()
        self.nc: NATS | None = None
        self.http: NodeClient | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: In-flight requests by (owner, front-door owner, request id): ids are scoped to owners.
        self._by_request: dict[str, asyncio.Task[None]] = {}
        self._follow: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._follow_costs: asyncio.Task[None] | None = None
        self._api_keys = {n.id: n.api_key for n in cfg.nodes if n.api_key}
        #: Cancelled requests (by owner key) not held here (not arrived yet, or waiting in the queue).
        self._cancelled = CancelBook()
        self.queue: SaturationQueue | None = None
        self._default_timeout = cfg.defaults.request_timeout_s
        self.metrics = RouterMetrics(self)
        #: Plans of NATS client identities (zml creds issue NAME --plan ...): zml_router.limits.
        self.limits = IdentityLimits()
        #: Requests whose requester asked for keepalives (zmlcore.keepalive), by reply subject.
        self.keepalives = KeepaliveBook()
        self._keepalive_task: asyncio.Task[None] | None = None
        #: Callers' request ids in flight on every replica (zml_router.ids).
        self.ids: RequestIds | None = None
        #: Completion events, published together every few ms (zmlcore.batchpub).
        self.events: BatchPublisher | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.http = NodeClient(self.cfg.router.max_connections, self.cfg.router.connect_timeout_s)
        self.events = BatchPublisher(nc, _EVENT_COMPLETED, COMPLETED_WINDOW_S)
        self.events.start()
        if self.cfg.router.stale_after_s < 2 * self.cfg.health.poll_interval_s:
            log.warning("[router] stale_after_s (%g s) is under two health polls (%g s each): nodes will "
                        "flap to stale between polls", self.cfg.router.stale_after_s, self.cfg.health.poll_interval_s)
        # Followers re-create their watch (and re-read the snapshot) after every reconnect.
        self.nodes_follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=self.table.put_raw,
                                         on_delete=self.table.delete_raw)
        self._follow = asyncio.create_task(self.nodes_follower.run())
        self._follow_costs = asyncio.create_task(self.table.costs.follower(nc).run())
        # A snapshot before taking traffic; an empty bucket has nothing to wait for.
        await self.nodes_follower.wait_ready(2.0)
        await self.limits.start(nc)
        self.ids = RequestIds(nc, self.router_id, self.cfg.defaults.max_request_timeout_s)
        await self.ids.open()
        self.queue = SaturationQueue(nc, self._room_for_queued, self._dispatch_queued, self._expire_queued,
                                     self._queued_cancelled, owner=self.router_id)
        self.table.on_change = self.queue.capacity.set
        await self.queue.start(sorted(self.cfg.model_names()))
        self._subs.append(await nc.subscribe(subjects.INFLIGHT, cb=self._on_delta))
        self._subs.append(await nc.subscribe(subjects.INFLIGHT_SNAPSHOT, cb=self._on_snapshot))
        self._subs.append(await nc.subscribe(subjects.NODE_MARKS, cb=self._on_mark))
        self._heartbeat = asyncio.create_task(self._publish_snapshots())
        self._keepalive_task = asyncio.create_task(send_keepalives(self.keepalives, nc))
        self.metrics.start()
        self._subs.append(await nc.subscribe(f"{subjects.CANCEL_PREFIX}.>", cb=self._on_cancel))
        self._subs.append(await nc.subscribe(subjects.router_state(self.router_id), cb=self._on_state))
        self._subs.append(await nc.subscribe(subjects.ROUTERS_STATE, cb=self._on_state))
        self._subs.append(
            await nc.subscribe(subjects.INFER, queue=subjects.ROUTER_QUEUE, cb=self._on_request)
        )
        self._subs.append(
            await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=self._on_request)
        )

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
        await cancel_and_wait([t for t in (self._follow, self._heartbeat, self._follow_costs, self._keepalive_task)
                               if t is not None])
        if self.events is not None:
            await self.events.stop()
        await self.metrics.stop()
        await self.limits.stop()
        if self.http:
            await self.http.aclose()

    # --- subscriptions ---------------------------------------------------------------------
    async def _on_request(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: hand off at once.
        front_door_headers(msg)  # what the sender may not set is dropped here (zml_router.trust)
        task = asyncio.create_task(self._enter(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_delta(self, msg: Msg) -> None:
        try:
            d = _delta_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if d.router_id != self.router_id:
            self.table.apply_delta(d, time.time())
            if d.outstanding < 0 and self.queue is not None:
                self.queue.capacity.set()

    async def _on_snapshot(self, msg: Msg) -> None:
        try:
            snap = _snapshot_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if snap.router_id != self.router_id:
            self.table.apply_snapshot(snap, time.time())

    async def _on_mark(self, msg: Msg) -> None:
        try:
            mark = node_mark_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if self.marks.apply_peer(mark, time.time()):
            log.info("%s marked %s %s for %.1f s (%s)", mark.router_id, mark.node_id, mark.kind, mark.for_s,
                     mark.reason)

    async def _publish_snapshots(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY_S)
            now = time.time()
            if self.table.expire_peers(now) and self.queue is not None:
                self.queue.capacity.set()
            if self.nc is not None and self.nc.is_connected:
                snap = InflightSnapshot(router_id=self.router_id, ts=now, nodes=self.table.own_snapshot())
                await self.nc.publish(subjects.INFLIGHT_SNAPSHOT, _encode(snap))

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
        self._cancelled.add(key, time.time())

    async def _on_state(self, msg: Msg) -> None:
        now = time.time()
        nodes = {
            v.node_id: {
                "status": v.state.status,
                "outstanding": v.outstanding,
                "pending": v.pending,
                "own": self.table.own.get(v.node_id, [0, 0]),
                "effective_outstanding": v.effective_outstanding(),
                "cooldown_s": round(max(0.0, v.cooldown_until - now), 3),
                "saturated_s": round(max(0.0, v.saturated_until - now), 3),
                "state_age_s": round(now - v.state.updated_at, 3),
                "cost_per_hour": v.state.cost_per_hour,
                **self.marks.describe(v.node_id, now),
            }
            for v in self.table.nodes()
        }
        await msg.respond(_encode({"router_id": self.router_id, "in_flight": len(self._by_request), "nodes": nodes}))

    # --- the request path ------------------------------------------------------------------
    def _enter(self, msg: Msg | QueuedMsg) -> Coroutine[Any, Any, None]:
        """The request path; inside a server span when tracing is on (zml_router.tracing)."""
        return rtrace.handle(self, msg) if tracing.ON else self._handle(msg)

    async def _handle(self, msg: Msg | QueuedMsg) -> None:
        t0 = time.monotonic()
        headers = msg.headers or {}
        asked_id = headers.get(subjects.H_REQUEST_ID, "")
        request_id = ""  # set once validated: it goes into subjects, headers and logs
        stream = False
        out = _Outcome()
        idclaims.CURRENT.set(None)  # not one inherited from the task that started this one
        try:
            req = decode_request(msg.data, max_depth=self.cfg.defaults.max_json_depth)
            stream = req.stream
            request_id = check_request_id(asked_id or req.request_id or _new_id())
            REQUEST_ID.set(request_id)  # on every log line of this request (JSON logs)
            if msg.reply and self.nc is not None:  # a reply the requester could not receive: refuse now
                mc = self.cfg.models.get(self.cfg.resolve_model(req.model))
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
            task = asyncio.current_task()
            assert task is not None
            key = _owner_key(msg.reply, headers, request_id)
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
                    await self._publish(msg.reply, b"", keepalive_headers())
            lease: Lease | None = None
            try:
                if self._cancelled.take(key, time.time()):  # the cancel overtook the request
                    raise asyncio.CancelledError
                idclaims.CURRENT.set(await self._claim_id(msg, headers, key, req, timeout, request_id))
                if not isinstance(msg, QueuedMsg):  # a queued request was counted when it arrived
                    lease = await self.limits.admit(owner, request_id, timeout)
                async with asyncio.timeout(timeout):
                    await self._route(msg, req, request_id, t0, timeout, out)
            except asyncio.TimeoutError as exc:
                raise TimeoutError(f"request exceeded its timeout of {timeout:g} s") from exc
            finally:
                if self._by_request.get(key) is task:
                    del self._by_request[key]
                self.keepalives.remove(msg.reply)
                if not out.queued:  # a queued request keeps its claim until it is answered
                    await self.ids.release_current()  # type: ignore[union-attr]
                self.limits.done(lease, (out.info.total_tokens or 0) if out.ok and out.info else 0)
                if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                    msg.placed.set_result(True)
        except asyncio.CancelledError:
            out.error_code = CancelledError.code
            await self._reply_error(msg, CancelledError("request cancelled"), stream)
        except ZMLError as exc:
            out.error_code = exc.code
            await self._reply_error(msg, exc, stream)
        except Exception as exc:  # a bug must not kill the router: answer INTERNAL, log it
            out.error_code = ZMLError.code
            log.exception("internal error on request %s", request_id)
            await self._reply_error(msg, ZMLError(f"internal error: {type(exc).__name__}"), stream)
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

    def _queued_cancelled(self, qmsg: QueuedMsg) -> bool:
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        key = _owner_key(qmsg.reply, qmsg.headers, request_id)
        if not self._cancelled.seen(key, time.time()):
            return False
        if self.ids is not None:  # dropped from the queue without a reply: free its id now
            task = asyncio.create_task(self.ids.release(idclaims.queued_claim(key, qmsg.headers)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    def _prepare(self, req: InferRequest, raw: bytes) -> tuple[str, ResolvedPolicy, RouteRequest]:
        model = self.cfg.resolve_model(req.model)
        per_call = req.policy if req.policy is not None else req.routing
        # Chains may name families registered at run time, not only zml.toml's.
        policy = resolve_policy(self.cfg, model, per_call, self.table.families())
        check_kind(self.cfg, model, req)
        # An embedding is a prefill and no decode: one "output token" for the estimate.
        max_tokens = 1 if req.input is not None else req.max_tokens or req.max_completion_tokens or 512
        # ~4 bytes per token of JSON body: good enough for a TTFT estimate, and O(1).
        rr = RouteRequest(model=model, prompt_tokens=len(raw) // 4, max_tokens=max_tokens,
                          accelerator_id=req.accelerator_id)
        return model, policy, rr

    async def _route(self, msg: Msg | QueuedMsg, req: InferRequest, request_id: str, t0: float,
                     timeout: float, out: _Outcome) -> None:
        out.model, out.op = self.cfg.resolve_model(req.model), req.kind()
        model, policy, rr = self._prepare(req, msg.data)
        max_tokens = rr.max_tokens
        body = self._backend_body(msg.data, model, req.model)
        excluded: set[str] = set()
        last: AttemptError | None = None
        if (policy.config.queue_on_saturation and self.queue is not None and msg.reply
                and not isinstance(msg, QueuedMsg) and self.queue.has_waiting(model)):
            # Others are waiting for this model: take a place behind them, do not overtake.
            out.queued = True
            await self._enqueue(msg, req, model, request_id, policy.config.max_queue_ms, timeout)
            return
        for attempt in range(1, self.cfg.router.max_attempts + 1):
            if excluded:
                rr = RouteRequest(model=model, prompt_tokens=rr.prompt_tokens, max_tokens=max_tokens,
                                  accelerator_id=req.accelerator_id, exclude=frozenset(excluded))
            try:
                decision = self.metrics.decide(self._decide, rr, policy)
            except QueueFullError:
                if last is None and policy.config.queue_on_saturation and self.queue is not None and msg.reply:
                    out.queued = True
                    await self._saturated(msg, req, model, request_id, policy.config.max_queue_ms, timeout)
                    return
                if last is not None:
                    break
                raise
            except ZMLError:
                if last is not None:  # we tried nodes and they failed: say so, not "no nodes"
                    break
                raise
            out.node_id, out.family, out.attempts = decision.node_id, decision.family, attempt
            out.info = None
            info = RoutingInfo(
                node_id=decision.node_id,
                accelerator_type=self.table.views[decision.node_id].state.accelerator_type,
                family=decision.family,
                policy=decision.policy,
                queue_depth_at_dispatch=decision.queue_depth,
                decision_id=_new_id(),
                request_id=request_id,
                attempts=attempt,
                router_id=self.router_id,
                label=out.label,
            )
            out.info = info
            DECISION_ID.set(info.decision_id)
            served = self.table.views[decision.node_id].state.served_names.get(model)
            node_body = self._backend_body(msg.data, served, req.model) if served else body
            first_byte = self._first_byte_s(decision.node_id, req, rr)
            # The engine answers with its own name: the client gets back the name it asked for.
            rename = Renamer(served, req.model) if served and served != req.model else None
            try:
                if req.stream:
                    await self._dispatch_stream(msg, req, node_body, info, t0, first_byte, rename)
                else:
                    await self._dispatch_once(msg, req, node_body, info, t0, first_byte, rename)
                out.ok = True
                return
            except AttemptError as err:
                last = err
                self.metrics.failover(decision.node_id, err.failure.value)
                out.node_error = err.failure in (Failure.NETWORK, Failure.SERVER, Failure.SLOW)
                if out.node_error:
                    out.failed_nodes.append(decision.node_id)
                if err.failure is Failure.SLOW:
                    out.slow_nodes.append(decision.node_id)
                if err.failure is Failure.CLIENT:
                    raise BadRequestError(f"node {decision.node_id} rejected the request: {err.detail}") from None
                await self._penalise(decision, err)
                if err.mid_stream:  # part of the answer is out: no invisible failover now
                    raise BackendError(f"node {decision.node_id} failed mid-stream: {err.failure.value} {err.detail}",
                                       retry_after=1.0) from None
                excluded.add(decision.node_id)
                log.info("attempt %d on %s failed (%s %s); re-routing", attempt, decision.node_id,
                         err.failure.value, err.status)
        assert last is not None
        if last.failure is Failure.OVERLOADED:
            # Every node tried answered "overloaded": that is saturation, not a failure.
            if policy.config.queue_on_saturation and self.queue is not None and msg.reply:
                out.queued = True
                await self._saturated(msg, req, model, request_id, policy.config.max_queue_ms, timeout)
                return
            pinned = req.accelerator_id is not None  # the node was the caller's choice, not the policy's
            raise QueueFullError(
                f"node {req.accelerator_id!r} is overloaded" if pinned else
                f"every node tried for {model!r} is overloaded ({len(excluded)} tried)",
                routing_context={"policy": "pinned" if pinned else policy.name, "final_error": "all_nodes_over_capacity",
                                 "nodes_tried": sorted(excluded),
                                 "recommendation": "increase fleet capacity or enable queue_on_saturation"},
                retry_after=last.retry_after or 1.0,
            )
        if last.failure is Failure.NO_MODEL:
            raise ModelNotLoadedError(f"no node could serve model {model!r}: {last.detail}")
        raise BackendError(
            f"{len(excluded)} node(s) failed for this request; last: {last.failure.value} {last.status} {last.detail}".strip(),
            retry_after=1.0,
        )

    async def _completed(self, out: _Outcome, request_id: str, t0: float) -> None:
        """One event per finished request (warmup measures demand, health counts node errors)."""
        if self.nc is None:
            return
        info = out.info
        node_error = not out.ok and out.node_error
        failed = out.failed_nodes[:-1] if node_error else out.failed_nodes
        ev = RequestCompleted(
            model=out.model, node_id=out.node_id, family=out.family, ok=out.ok, error_code=out.error_code,
            node_error=node_error, failed_nodes=failed, ts=time.time(),
            ttft_s=info.time_to_first_token if info is not None and out.ok else None,
            latency_s=time.monotonic() - t0, attempts=out.attempts, router_id=self.router_id,
            request_id=request_id, slow_nodes=out.slow_nodes, label=out.label,
        )
        if self.events is not None:  # sent off the request path, with the others of the next ms
            self.events.add(completed_encoder.encode(ev))

    def _decide(self, rr: RouteRequest, policy: ResolvedPolicy) -> Decision:
        """choose_node plus the admission bound (pure maths, local table: no network)."""
        now = time.time()
        rc = self.cfg.router
        try:
            decision = choose_node(self.table.nodes(), rr, policy, now, self.state, stale_after_s=rc.stale_after_s)
        except (NoHealthyNodesError, QueueFullError):
            if not self._half_open(rr, now):
                raise
            decision = choose_node(self.table.nodes(), rr, policy, now, self.state, stale_after_s=rc.stale_after_s)
        if decision.estimated_ttft_s <= rc.admission_ttft_s or rr.accelerator_id is not None:
            return decision
        # The policy's pick is over the bound; is any node under it? The latency policy's
        # pick has the smallest estimate of all.
        fastest = choose_node(self.table.nodes(), rr, _LATENCY, now, self.state, stale_after_s=rc.stale_after_s)
        if fastest.estimated_ttft_s <= rc.admission_ttft_s:
            return fastest
        raise QueueFullError(
            f"every node serving {rr.model!r} is saturated (best estimated time to first token "
            f"{fastest.estimated_ttft_s:.1f} s > admission bound {rc.admission_ttft_s:g} s)",
            routing_context={
                "policy": policy.name,
                "evaluated": [e.as_dict() for e in decision.evaluated],
                "final_error": "all_nodes_over_capacity",
                "best_estimated_ttft_s": round(fastest.estimated_ttft_s, 3),
                "recommendation": "increase fleet capacity or enable queue_on_saturation",
            },
            retry_after=1.0,
        )

    def _half_open(self, rr: RouteRequest, now: float) -> bool:
        """Every node that could serve is cooling down after failures: rather than refuse the
        request, give the node whose cooldown ends first one more chance (a half-open circuit
        breaker). A failure puts it straight back. This stops a burst of failures on a starved
        host from taking the whole fleet out for ``cooldown_s``."""
        stale = self.cfg.router.stale_after_s
        cooling = [v for v in self.table.nodes()
                   if v.node_id not in rr.exclude and is_routable(v, rr.model, now, stale) == "cooldown"
                   and (rr.accelerator_id is None or v.node_id == rr.accelerator_id)]
        if not cooling:
            return False
        v = min(cooling, key=lambda v: v.cooldown_until)
        log.warning("every node for %s is cooling down; trying %s again early", rr.model, v.node_id)
        v.cooldown_until = 0.0
        return True

    # --- the saturation queue --------------------------------------------------------------------
    async def _saturated(self, msg: Msg | QueuedMsg, req: InferRequest, model: str, request_id: str,
                         max_queue_ms: int | None, timeout: float) -> None:
        """No room now: a queued head goes back to the router holding it (keeping its place);
        anything else joins the queue."""
        if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
            msg.placed.set_result(False)
            return
        await self._enqueue(msg, req, model, request_id, max_queue_ms, timeout)

    async def _enqueue(self, msg: Msg | QueuedMsg, req: InferRequest, model: str, request_id: str,
                       max_queue_ms: int | None, timeout: float) -> None:
        assert self.queue is not None
        now = time.time()
        wait_s = (max_queue_ms or 0) / 1000.0
        deadline = now + min(wait_s, timeout)
        # What waits with the request (owner, the key's options, trace context): queue.H_QUEUED_HEADERS.
        headers = {k: v for k, v in (msg.headers or {}).items() if k in H_QUEUED_HEADERS}
        headers[subjects.H_REQUEST_ID] = request_id
        headers[subjects.H_TIMEOUT_MS] = str(int(timeout * 1000))
        claim = idclaims.CURRENT.get()
        if claim is not None:  # the request keeps its id while it waits (zml_router.ids)
            headers[idclaims.H_ID_CLAIM] = str(claim.revision)
        if isinstance(msg, QueuedMsg):
            # Back in the queue after losing a race for capacity: keep its deadlines.
            deadline = float(msg.headers.get(H_DEADLINE, deadline))
            headers[H_ENQUEUED] = msg.headers.get(H_ENQUEUED, f"{now:.3f}")
            headers[subjects.H_TIMEOUT_MS] = msg.headers.get(H_TOTAL_MS, headers[subjects.H_TIMEOUT_MS])
        self.metrics.enqueued(model, headers)
        if subjects.H_KEEPALIVE in headers:
            # Before the entry exists: a requester told "queued" never sends it again, while one
            # that missed this (we died first) finds nothing queued that could run twice.
            self.keepalives.remove(msg.reply)
            await self._publish(msg.reply, b"", keepalive_headers(QUEUED))
        await self.queue.enqueue(model, msg.data, msg.reply, headers, deadline)
        log.info("request %s queued for %s (up to %.0f ms)", request_id, model, wait_s * 1000)

    def _room_for_queued(self, qmsg: QueuedMsg) -> bool:
        """Has a node room for the head of a model's queue now?"""
        try:
            req = infer_request_decoder.decode(qmsg.data)
            model, policy, rr = self._prepare(req, qmsg.data)
            self._decide(rr, policy)
            self.metrics.waited(model, qmsg.headers)
        except QueueFullError:
            return False
        except (ZMLError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # not a capacity question: the normal path answers it
        return True

    async def _dispatch_queued(self, qmsg: QueuedMsg, deadline: float) -> bool:
        """Dispatch the (claimed) head of a model's queue; False if a node refused it at once."""
        # The request's timeout counts from when it first arrived, not from now.
        enqueued = float(qmsg.headers.get(H_ENQUEUED, time.time()))
        total_ms = int(qmsg.headers.get(subjects.H_TIMEOUT_MS, "0") or 0) or int(self._default_timeout * 1000)
        left_ms = max(1, total_ms - int((time.time() - enqueued) * 1000))
        headers = {**qmsg.headers, subjects.H_TIMEOUT_MS: str(left_ms), H_TOTAL_MS: str(total_ms)}
        # The head stays unacknowledged (in JetStream) until a node has taken the request: an
        # immediate overload answer hands it back here. Its claim (queue.py) keeps a replica
        # that gets it redelivered after we die from running it a second time.
        placed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._enter(QueuedMsg(qmsg.subject, qmsg.data, qmsg.reply, headers, placed)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        waits: list[asyncio.Future[Any]] = [placed, task]
        await asyncio.wait(waits, timeout=PLACEMENT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        if placed.done():
            if not placed.result() and subjects.H_KEEPALIVE in qmsg.headers:
                # Back to waiting (the claim is released after this): not watched meanwhile.
                await self._publish(qmsg.reply, b"", keepalive_headers(QUEUED))
            return placed.result()
        placed.set_result(True)  # still running on a node after the wait: it has been taken
        return True

    async def _expire_queued(self, qmsg: QueuedMsg, enqueued_at: float) -> None:
        self.metrics.expired(qmsg.data)
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        idclaims.CURRENT.set(idclaims.queued_claim(_owner_key(qmsg.reply, qmsg.headers, request_id), qmsg.headers))
        waited_ms = int((time.time() - enqueued_at) * 1000)
        try:
            stream = infer_request_decoder.decode(qmsg.data).stream
        except (msgspec.DecodeError, msgspec.ValidationError):
            stream = False
        exc = QueueFullError(
            f"no node had room within max_queue_ms (waited {waited_ms} ms)",
            routing_context={"final_error": "queue_timeout", "waited_ms": waited_ms,
                             "recommendation": "increase fleet capacity or max_queue_ms"},
            retry_after=1.0,
        )
        await self._reply_error(qmsg, exc, stream)

    async def _penalise(self, decision: Decision, err: AttemptError) -> None:
        """Skip a node that failed or refused, here and (over NATS) on every replica."""
        rc = self.cfg.router
        reason = "mid_stream" if err.mid_stream else err.failure.value
        if err.failure is Failure.OVERLOADED:
            # "Retry-After: 0" from an overloaded node would mean "hammer me": use the default.
            kind, for_s = "saturated", err.retry_after or rc.saturated_s
        elif err.failure in (Failure.NETWORK, Failure.SERVER, Failure.SLOW):
            kind, for_s = "cooldown", err.retry_after if err.retry_after is not None else rc.cooldown_s
        else:
            return
        mark = self.marks.mark(decision.node_id, kind, for_s, reason, time.time())
        if mark is not None and self.nc is not None:
            try:
                await self.nc.publish(subjects.NODE_MARKS, _encode(mark))
            except Exception:  # a peer learning late is no reason to fail the request
                log.debug("node mark not published", exc_info=True)

    def _first_byte_s(self, node_id: str, req: InferRequest, rr: RouteRequest) -> float | None:
        """The attempt's first-byte deadline (none for a pinned request: it cannot move)."""
        view = self.table.views.get(node_id)
        if view is None or req.accelerator_id is not None:
            return None
        rc = self.cfg.router
        expected = expected_s(view.state, view.outstanding, view.pending, rr.prompt_tokens, rr.max_tokens, req.stream)
        return first_byte_timeout(expected, rc.first_byte_floor_s, rc.first_byte_factor)

    def _backend_body(self, raw: bytes, model: str, asked: str) -> bytes:
        if model == asked and not any(k in raw for k in _ZML_KEYS_BYTES):
            return raw  # nothing of ours to strip: forward the caller's bytes untouched
        data: dict[str, Any] = _decode_any.decode(raw)
        for key in ZML_REQUEST_KEYS:
            data.pop(key, None)
        data["model"] = model
        return _encode(data)

    def _backend_headers(self, info: RoutingInfo) -> dict[str, str]:
        h = {
            "content-type": "application/json",
            "x-zml-routing": (
                f"node={info.node_id};family={info.family};policy={info.policy};"
                f"queue={info.queue_depth_at_dispatch};decision={info.decision_id}"
            ),
            "x-request-id": info.request_id,
        }
        key = self._api_keys.get(info.node_id)
        if key:
            h["authorization"] = f"Bearer {key}"
        self.metrics.dispatching(h, info)  # traceparent of the attempt span, when tracing
        return h

    def _url(self, info: RoutingInfo, req: InferRequest) -> str:
        return self.table.views[info.node_id].state.endpoint.rstrip("/") + PATHS[req.kind()]

    # --- in-flight accounting ----------------------------------------------------------------
    async def _count(self, node_id: str, outstanding: int, pending: int) -> None:
        self.table.add_own(node_id, outstanding, pending)
        if outstanding < 0 and self.queue is not None:
            self.queue.capacity.set()
        # Deltas are for peers: alone, skip them (a replica that joins learns our counts from
        # the next 1 s snapshot). Saves a NATS send per message on the hot path.
        if self.nc is not None and self.table.peers:
            delta = InflightDelta(router_id=self.router_id, node_id=node_id, outstanding=outstanding,
                                  pending=pending, ts=time.time())
            # publish() only appends to the client's buffer; its flusher sends batches.
            await self.nc.publish(subjects.INFLIGHT, _encode(delta))

    async def _dispatch_once(self, msg: Msg | QueuedMsg, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                             first_byte: float | None = None, rename: Renamer | None = None) -> None:
        # A non-streamed reply shows no first token: pending ends with the request.
        await self._count(info.node_id, 1, 1)
        try:
            raw = await within_first_byte(
                post_json(self.http, self._url(info, req), body, self._backend_headers(info),  # type: ignore[arg-type]
                          self.cfg.nats.max_reply_bytes), first_byte)
        finally:
            await self._count(info.node_id, -1, -1)
        info.time_to_first_token = time.monotonic() - t0
        self.metrics.usage(req.kind(), req.model, raw)
        if rename is not None:
            raw = rename(raw)
        # Over max_payload: in parts to a requester that collects them (zmlcore.bigreply), else
        # REPLY_TOO_LARGE (raised before anything is sent), never a lost reply.
        await self.ids.release_current()  # type: ignore[union-attr]  # before the caller can reuse the id
        if msg.reply and self.nc is not None:
            await publish_reply(self.nc, msg.reply, _with_routing(raw, info), self._routing_headers(info),
                                accepted(msg.headers))

    async def _dispatch_stream(self, msg: Msg | QueuedMsg, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                               first_byte: float | None = None, rename: Renamer | None = None) -> None:
        await self._count(info.node_id, 1, 1)
        pending = 1
        started = False
        seq = 0
        # Relayed as the node framed it to a requester that writes SSE itself (the gateway).
        relay = rename is None and (msg.headers or {}).get(subjects.H_ACCEPT_STREAM) == subjects.STREAM_EVENTS
        kind = subjects.STREAM_EVENTS if relay else subjects.STREAM_CHUNK
        chunks = stream_sse(self.http, self._url(info, req), body, self._backend_headers(info), relay)  # type: ignore[arg-type]
        try:
            async for chunk in first_chunk_within(chunks, first_byte):
                if not started:
                    started = True
                    pending = 0
                    if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                        msg.placed.set_result(True)
                    await self._count(info.node_id, 0, -1)
                    info.time_to_first_token = time.monotonic() - t0
                    await self._publish(msg.reply, _encode(StreamStart(routing=info)),
                                        {**self._routing_headers(info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
                usage = stream_usage(chunk)
                if usage is not None:
                    info.total_tokens = usage["total_tokens"]
                    self.metrics.usage_dict(req.kind(), req.model, usage)
                if rename is not None:
                    chunk = rename(chunk)
                seq += 1  # numbered so that a receiver notices a lost message (zmlcore.streamseq)
                await self._publish(msg.reply, chunk, {subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)})
            if not started:  # a stream with no chunk at all
                info.time_to_first_token = time.monotonic() - t0
                await self._publish(msg.reply, _encode(StreamStart(routing=info)),
                                    {**self._routing_headers(info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
            await self.ids.release_current()  # type: ignore[union-attr]
            await self._publish(msg.reply, _encode(StreamStart(routing=info)),
                                {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(seq + 1)})
        except AttemptError as err:
            # Before the first token _route re-dispatches invisibly; after it, it cools the node
            # and ends the stream with an error.
            err.mid_stream = started
            raise
        finally:
            await self._count(info.node_id, -1, -pending)

    # --- replies -------------------------------------------------------------------------------
    @staticmethod
    def _routing_headers(info: RoutingInfo) -> dict[str, str]:
        return {
            subjects.H_REQUEST_ID: info.request_id,
            subjects.H_NODE_ID: info.node_id,
            subjects.H_ACCELERATOR_TYPE: info.accelerator_type,
            subjects.H_FAMILY: info.family,
            subjects.H_POLICY: info.policy,
            subjects.H_QUEUE_DEPTH: str(info.queue_depth_at_dispatch),
            subjects.H_DECISION_ID: info.decision_id,
        }

    async def _publish(self, reply: str, data: bytes, headers: dict[str, str]) -> None:
        if reply and self.nc is not None:
            await self.nc.publish(reply, data, headers=headers)
            if self.keepalives:  # the next keepalive is an interval after this message
                self.keepalives.sent(reply, time.monotonic())

    async def _reply_error(self, msg: Msg | QueuedMsg, exc: ZMLError, stream: bool) -> None:
        headers = {subjects.H_ERROR_CODE: exc.code, **getattr(exc, "nats_headers", {})}
        if exc.retry_after is not None:
            headers[subjects.H_RETRY_AFTER] = f"{exc.retry_after:g}"
        if stream:
            headers[subjects.H_STREAM] = subjects.STREAM_ERROR
        try:
            if self.ids is not None:
                await self.ids.release_current()
            await self._publish(msg.reply, _encode(exc.to_body()), headers)
        except Exception:  # connection closing: the requester times out on its side
            log.warning("could not send error reply %s", exc.code)
