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
from zmlcore.errors import QueueFullError, ZMLError
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

log = logging.getLogger("zml.router")

#: A queued head is acknowledged once its node has not refused it within this long.
PLACEMENT_WAIT_S = 0.5

Admit = Callable[[RouteRequest, ResolvedPolicy], Decision]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class QueueGlue:
    """``admit``: the router's decision for a request (``zmlcore.policy.admit`` on its table);
    ``enter``: the request path, which a dispatched head goes down as a :class:`QueuedMsg`;
    ``spawn``: a task the router waits for when it stops."""

    def __init__(self, cfg: ZMLConfig, table: NodeTable, admit: Admit, metrics: RouterMetrics, replies: Replies,
                 cancels: CancelBook, ids: RequestIds, enter: Callable[[QueuedMsg], Coroutine[Any, Any, None]],
                 spawn: Spawn) -> None:
        self.cfg = cfg
        self.table = table
        self.admit = admit
        self.metrics = metrics
        self.replies = replies
        self.cancels = cancels
        self.ids = ids
        self.enter = enter
        self.spawn = spawn
        self.queue: SaturationQueue | None = None

    async def start(self, nc: NATS, router_id: str) -> SaturationQueue:
        """The queue's stream, claims and a worker per configured model (``zml_router.queue.jetstream``)."""
        self.queue = SaturationQueue(nc, self.has_room, self.dispatch, self.expire, self.cancelled, owner=router_id)
        await self.queue.start(sorted(self.cfg.model_names()))
        return self.queue

    async def saturated(self, msg: Incoming, req: InferRequest, model: str, request_id: str,
                        max_queue_ms: int | None, timeout: float) -> None:
        """No room now: a queued head goes back to the router holding it (keeping its place);
        anything else joins the queue."""
        if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
            msg.placed.set_result(False)
            return
        await self.enqueue(msg, req, model, request_id, max_queue_ms, timeout)

    async def enqueue(self, msg: Incoming, req: InferRequest, model: str, request_id: str,
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
    def has_room(self, qmsg: QueuedMsg) -> bool:
        """Has a node room for the head of a model's queue now? (Asked again each time capacity
        may have freed: the head's wait is observed once, when a node takes it.)"""
        try:
            req = infer_request_decoder.decode(qmsg.data)
            policy, rr = prepare(self.cfg, self.table.families(), req, qmsg.data, self.cfg.resolve_model(req.model),
                                 headers=qmsg.headers)
            self.admit(rr, policy)
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
        task = self.spawn(self.enter(QueuedMsg(qmsg.subject, qmsg.data, qmsg.reply, headers, placed)))
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
        self.metrics.expired(qmsg.data)
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        idclaims.CURRENT.set(idclaims.queued_claim(owner_key(qmsg.reply, qmsg.headers, request_id), qmsg.headers))
        waited_ms = int((time.time() - enqueued_at) * 1000)
        try:
            stream = infer_request_decoder.decode(qmsg.data).stream
        except (msgspec.DecodeError, msgspec.ValidationError):
            stream = False
        await self.replies.error(qmsg, queue_expired(waited_ms), stream)

    def cancelled(self, qmsg: QueuedMsg) -> bool:
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        key = owner_key(qmsg.reply, qmsg.headers, request_id)
        if not self.cancels.seen(key, time.time()):
            return False
        # Dropped from the queue without a reply: free its id now.
        self.spawn(self.ids.release(idclaims.queued_claim(key, qmsg.headers)))
        return True
