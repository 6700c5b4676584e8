"""The request path's side of the saturation queue (``zml_router.queue.jetstream``): putting a request
in when no node has room, and the callbacks the queue's head holder calls (room for the head?
dispatch it, expire it, was it cancelled?).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import QueueFullError, ShedError, ZMLError
from zmlcore.messages import InferRequest, infer_request_decoder
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest

from zml_router.replicas import ids as idclaims
from zml_router.request.cancels import CancelBook
from zml_router.incoming import Incoming, QueuedMsg
from zml_router.request.intake import owner_key
from zml_router.request.prepare import prepare
from zml_router.request.finish import queue_expired
from zml_router.replicas.ids import RequestIds
from zml_router.telemetry.metrics import RouterMetrics
from zml_router.queue.jetstream import H_DEADLINE, H_ENQUEUED, H_QUEUED_HEADERS, H_TOTAL_MS, SaturationQueue
from zml_router.answer.replies import Replies
from zml_router.replicas.table import NodeTable
from zml_router.request.flowgate import FlowGate
from zmlcore.flowctl import STANDARD, Waiting
from zmlcore.flowctl.order import rank_window
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, prompt_tokens_from_body

log = logging.getLogger("zml.router")

#: A queued head is acknowledged once its node has not refused it within this long.
PLACEMENT_WAIT_S = 0.5
#: Entries held beyond [flow] max_queued, so that a full queue still sees new arrivals to rank
#: (and sheds its lowest-ranked down to max_queued).
WINDOW_SLACK = 32

#: (request, policy, its queued headers: its band, tenant and targets, entries ranked before it)
#: -> the decision
Admit = Callable[[RouteRequest, ResolvedPolicy, dict[str, str], int], Decision]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class QueueGlue:
    """``admit``: the router's decision for a request (``zmlcore.policy.admit`` on its table);
    ``enter``: the request path, which a dispatched head goes down as a :class:`QueuedMsg`;
    ``spawn``: a task the router waits for when it stops."""

    def __init__(self, cfg: ZMLConfig, table: NodeTable, admit: Admit, metrics: RouterMetrics, replies: Replies,
                 cancels: CancelBook, ids: RequestIds, enter: Callable[[QueuedMsg], Coroutine[Any, Any, None]],
                 spawn: Spawn, gate: FlowGate | None = None) -> None:
        self.cfg = cfg
        self.table = table
        self.admit = admit
        self.metrics = metrics
        self.replies = replies
        self.cancels = cancels
        self.ids = ids
        self.enter = enter
        self.spawn = spawn
        #: Flow control (zml_router.request.flowgate): the queue's order by band and share.
        self.gate = gate
        #: stream sequence -> the held entry as the order sees it (read once per entry)
        self._seen: dict[int, Waiting] = {}
        self.queue: SaturationQueue | None = None

    async def start(self, nc: NATS, router_id: str) -> SaturationQueue:
        """The queue's stream, claims and a worker per configured model (``zml_router.queue.jetstream``)."""
        f = self.cfg.flow
        self.queue = SaturationQueue(nc, self.has_room, self.dispatch, self.expire, self.cancelled, owner=router_id,
                                     rank=self.rank if self.gate is not None else None, shed=self.shed,
                                     window=f.max_queued + WINDOW_SLACK if self.gate is not None else 1)
        await self.queue.start(sorted(self.cfg.model_names()))
        return self.queue

    async def saturated(self, msg: Incoming, req: InferRequest, model: str, request_id: str,
                        max_queue_ms: int | None, timeout: float, tenant: str = "",
                        budget_s: float | None = None) -> None:
        """No room now: a queued head goes back to the router holding it (keeping its place);
        anything else joins the queue."""
        if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
            msg.placed.set_result(False)
            return
        await self.enqueue(msg, req, model, request_id, max_queue_ms, timeout, tenant, budget_s)

    async def enqueue(self, msg: Incoming, req: InferRequest, model: str, request_id: str,
                      max_queue_ms: int | None, timeout: float, tenant: str = "",
                      budget_s: float | None = None) -> None:
        """``tenant``: whom its fair share counts (flow control); ``budget_s``: how long it may
        wait and still meet its TTFT target (zmlcore.flowctl.slo.queue_budget_s): its wait ends
        then, with SHED."""
        assert self.queue is not None
        now = time.time()
        wait_s = (max_queue_ms or 0) / 1000.0
        if budget_s is not None:
            wait_s = min(wait_s, max(0.0, budget_s))
        deadline = now + min(wait_s, timeout)
        # What waits with the request (owner, the key's options, trace context): queue.H_QUEUED_HEADERS.
        headers = {k: v for k, v in (msg.headers or {}).items() if k in H_QUEUED_HEADERS}
        if tenant:
            headers[subjects.H_TENANT] = tenant
        headers[subjects.H_REQUEST_ID] = request_id
        headers[subjects.H_TIMEOUT_MS] = str(int(timeout * 1000))
        claim = idclaims.CURRENT.get()
        if claim is not None:  # the request keeps its id while it waits (zml_router.replicas.ids)
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
            await self.replies.queued(msg.reply)
        await self.queue.enqueue(model, msg.data, msg.reply, headers, deadline)
        log.info("request %s queued for %s (up to %.0f ms)", request_id, model, wait_s * 1000)

    # --- the queue's callbacks ---------------------------------------------------------------------
    def _waiting(self, qmsg: QueuedMsg, seq: int) -> Waiting:
        w = self._seen.get(seq)
        if w is not None:
            return w
        assert self.gate is not None
        h = qmsg.headers
        try:
            model = self.cfg.resolve_model(infer_request_decoder.decode(qmsg.data).model)
            note = self.gate.note(subjects.INFER, "", h, model)
        except (ZMLError, msgspec.DecodeError, msgspec.ValidationError):
            note = None  # not a flow question: the normal path answers it
        band, tenant, weight = (note.ask.band, note.ask.tenant, note.ask.weight) if note is not None \
            else (STANDARD, h.get(subjects.H_TENANT, ""), 1.0)
        cost = self.gate.book.cost(prompt_tokens_from_body(len(qmsg.data)), MEAN_OUTPUT_TOKENS)
        w = self._seen[seq] = Waiting(band, tenant, weight, float(h.get(H_ENQUEUED, "0") or 0), seq, cost=cost)
        return w

    def rank(self, qmsgs: list[QueuedMsg], seqs: list[int]) -> tuple[list[int], list[int], tuple[int, int]]:
        """The held entries' order (zmlcore.flowctl.order.rank_window: band, share, arrival, each
        tenant's backlog over every replica's window), those past [flow] max_queued to shed (the
        flood's tail first), and the best entry's (band, over-share)."""
        assert self.gate is not None
        ws = [self._waiting(q, s) for q, s in zip(qmsgs, seqs)]
        live = set(seqs)
        for s in [s for s in self._seen if s not in live]:
            del self._seen[s]
        f = self.cfg.flow
        r = rank_window(ws, self.gate.book, time.time(), age_s=f.age_s, max_queued=f.max_queued)
        return r.order, r.shed, r.top

    def _leaving(self, qmsg: QueuedMsg, enqueued_at: float) -> tuple[int, bool]:
        """A request leaving the queue unserved (shed or expired): counted, its id's claim made
        the one its error reply frees; how long it waited (ms) and whether it asked a stream."""
        self.metrics.expired(qmsg.data)
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        idclaims.CURRENT.set(idclaims.queued_claim(owner_key(qmsg.reply, qmsg.headers, request_id), qmsg.headers))
        try:
            stream = infer_request_decoder.decode(qmsg.data).stream
        except (msgspec.DecodeError, msgspec.ValidationError):
            stream = False
        return int((time.time() - enqueued_at) * 1000), stream

    async def shed(self, qmsg: QueuedMsg, enqueued_at: float) -> None:
        """Displaced from a full queue by higher-ranked work: SHED."""
        waited_ms, stream = self._leaving(qmsg, enqueued_at)
        err = ShedError(f"the saturation queue is full ([flow] max_queued = {self.cfg.flow.max_queued}) and this "
                        f"request ranked last (waited {waited_ms} ms)",
                        routing_context={"final_error": "shed", "waited_ms": waited_ms}, retry_after=1.0)
        await self.replies.error(qmsg, err, stream)

    def has_room(self, qmsg: QueuedMsg) -> bool:
        """Has a node room for the head of a model's queue now? (Asked again each time capacity
        may have freed: the head's wait is observed once, when a node takes it.)"""
        try:
            req = infer_request_decoder.decode(qmsg.data)
            policy, rr = prepare(self.cfg, self.table.families(), req, qmsg.data, self.cfg.resolve_model(req.model),
                                 headers=qmsg.headers)
            self.admit(rr, policy, qmsg.headers, qmsg.ahead)
        except QueueFullError:
            return False
        except (ZMLError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # not a capacity question: the normal path answers it
        return True

    async def dispatch(self, qmsg: QueuedMsg, deadline: float) -> bool:
        """Dispatch the (claimed) head of a model's queue; False if a node refused it at once."""
        # The request's timeout counts from when it first arrived, not from now.
        enqueued = float(qmsg.headers.get(H_ENQUEUED, time.time()))
        total_ms = int(qmsg.headers.get(subjects.H_TIMEOUT_MS, "0") or 0) or int(self.cfg.defaults.request_timeout_s * 1000)
        left_ms = max(1, total_ms - int((time.time() - enqueued) * 1000))
        headers = {**qmsg.headers, subjects.H_TIMEOUT_MS: str(left_ms), H_TOTAL_MS: str(total_ms)}
        # The head stays unacknowledged (in JetStream) until a node has taken the request: an
        # immediate overload answer hands it back here. Its claim (jetstream.py) keeps a replica
        # that gets it redelivered after we die from running it a second time.
        placed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        task = self.spawn(self.enter(QueuedMsg(qmsg.subject, qmsg.data, qmsg.reply, headers, placed, qmsg.ahead)))
        waits: list[asyncio.Future[Any]] = [placed, task]
        await asyncio.wait(waits, timeout=PLACEMENT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        if placed.done():
            if not placed.result():
                if subjects.H_KEEPALIVE in qmsg.headers:
                    # Back to waiting (the claim is released after this): not watched meanwhile.
                    await self.replies.queued(qmsg.reply)
                return False
        else:
            placed.set_result(True)  # still running on a node after the wait: it has been taken
        self._waited(qmsg)
        return True

    def _waited(self, qmsg: QueuedMsg) -> None:
        """The head's time in the queue, observed once: when a node has taken it."""
        try:
            model = self.cfg.resolve_model(infer_request_decoder.decode(qmsg.data).model)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.metrics.waited(model, qmsg.headers)

    async def expire(self, qmsg: QueuedMsg, enqueued_at: float) -> None:
        waited_ms, stream = self._leaving(qmsg, enqueued_at)
        err: ZMLError = queue_expired(waited_ms)
        if subjects.H_TTFT_SLO_MS in qmsg.headers:  # its wait ran out its TTFT target: shed, not "full"
            err = ShedError(f"no node had room in time to meet its time-to-first-token target (waited {waited_ms} ms)",
                            routing_context={"final_error": "shed", "waited_ms": waited_ms}, retry_after=1.0)
        await self.replies.error(qmsg, err, stream)

    def cancelled(self, qmsg: QueuedMsg) -> bool:
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        key = owner_key(qmsg.reply, qmsg.headers, request_id)
        if not self.cancels.seen(key, time.time()):
            return False
        # Dropped from the queue without a reply: free its id now.
        self.spawn(self.ids.release(idclaims.queued_claim(key, qmsg.headers)))
        return True
