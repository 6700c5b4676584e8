"""The request path's side of the saturation queue (``zml_router.queue``): putting a request
in when no node has room, and the callbacks the queue's head holder calls (room for the head?
dispatch it, expire it, was it cancelled?).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from zmlcore import subjects
from zmlcore.errors import QueueFullError, ZMLError
from zmlcore.reply.keepalive import QUEUED, keepalive_headers
from zmlcore.messages import InferRequest, infer_request_decoder

from zml_router import ids as idclaims
from zml_router.flow import prepare, queue_expired
from zml_router.ids import claim_key
from zml_router.queue import H_DEADLINE, H_ENQUEUED, H_QUEUED_HEADERS, H_TOTAL_MS, QueuedMsg

if TYPE_CHECKING:
    from zml_router.service import RouterService

log = logging.getLogger("zml.router")

#: A queued head is acknowledged once its node has not refused it within this long.
PLACEMENT_WAIT_S = 0.5


def owner_key(reply: str, headers: dict[str, str], request_id: str) -> str:
    """Whose request id this is: the identity owning the reply inbox, narrowed by a front
    door's ``Zml-Owner`` (which can only split the sender's own namespace further)."""
    return claim_key(subjects.reply_owner(reply), headers.get(subjects.H_OWNER, ""), request_id)


class QueueGlue:
    def __init__(self, svc: RouterService) -> None:
        self.svc = svc

    async def saturated(self, msg: Msg | QueuedMsg, req: InferRequest, model: str, request_id: str,
                        max_queue_ms: int | None, timeout: float) -> None:
        """No room now: a queued head goes back to the router holding it (keeping its place);
        anything else joins the queue."""
        if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
            msg.placed.set_result(False)
            return
        await self.enqueue(msg, req, model, request_id, max_queue_ms, timeout)

    async def enqueue(self, msg: Msg | QueuedMsg, req: InferRequest, model: str, request_id: str,
                      max_queue_ms: int | None, timeout: float) -> None:
        svc = self.svc
        assert svc.queue is not None
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
        svc.metrics.enqueued(model, headers)
        if subjects.H_KEEPALIVE in headers:
            # Before the entry exists: a requester told "queued" never sends it again, while one
            # that missed this (we died first) finds nothing queued that could run twice.
            svc.keepalives.remove(msg.reply)
            await svc.publish(msg.reply, b"", keepalive_headers(QUEUED))
        await svc.queue.enqueue(model, msg.data, msg.reply, headers, deadline)
        log.info("request %s queued for %s (up to %.0f ms)", request_id, model, wait_s * 1000)

    # --- the queue's callbacks ---------------------------------------------------------------------
    def has_room(self, qmsg: QueuedMsg) -> bool:
        """Has a node room for the head of a model's queue now? (Asked again each time capacity
        may have freed: the head's wait is observed once, when a node takes it.)"""
        svc = self.svc
        try:
            req = infer_request_decoder.decode(qmsg.data)
            policy, rr = prepare(svc.cfg, svc.table.families(), req, qmsg.data, svc.cfg.resolve_model(req.model))
            svc.admission.decide(rr, policy)
        except QueueFullError:
            return False
        except (ZMLError, msgspec.DecodeError, msgspec.ValidationError):
            pass  # not a capacity question: the normal path answers it
        return True

    async def dispatch(self, qmsg: QueuedMsg, deadline: float) -> bool:
        """Dispatch the (claimed) head of a model's queue; False if a node refused it at once."""
        svc = self.svc
        # The request's timeout counts from when it first arrived, not from now.
        enqueued = float(qmsg.headers.get(H_ENQUEUED, time.time()))
        total_ms = int(qmsg.headers.get(subjects.H_TIMEOUT_MS, "0") or 0) or int(svc.cfg.defaults.request_timeout_s * 1000)
        left_ms = max(1, total_ms - int((time.time() - enqueued) * 1000))
        headers = {**qmsg.headers, subjects.H_TIMEOUT_MS: str(left_ms), H_TOTAL_MS: str(total_ms)}
        # The head stays unacknowledged (in JetStream) until a node has taken the request: an
        # immediate overload answer hands it back here. Its claim (queue.py) keeps a replica
        # that gets it redelivered after we die from running it a second time.
        placed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        task = svc.spawn(svc.enter(QueuedMsg(qmsg.subject, qmsg.data, qmsg.reply, headers, placed)))
        waits: list[asyncio.Future[Any]] = [placed, task]
        await asyncio.wait(waits, timeout=PLACEMENT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        if placed.done():
            if not placed.result():
                if subjects.H_KEEPALIVE in qmsg.headers:
                    # Back to waiting (the claim is released after this): not watched meanwhile.
                    await svc.publish(qmsg.reply, b"", keepalive_headers(QUEUED))
                return False
        else:
            placed.set_result(True)  # still running on a node after the wait: it has been taken
        self._waited(qmsg)
        return True

    def _waited(self, qmsg: QueuedMsg) -> None:
        """The head's time in the queue, observed once: when a node has taken it."""
        try:
            model = self.svc.cfg.resolve_model(infer_request_decoder.decode(qmsg.data).model)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.svc.metrics.waited(model, qmsg.headers)

    async def expire(self, qmsg: QueuedMsg, enqueued_at: float) -> None:
        svc = self.svc
        svc.metrics.expired(qmsg.data)
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        idclaims.CURRENT.set(idclaims.queued_claim(owner_key(qmsg.reply, qmsg.headers, request_id), qmsg.headers))
        waited_ms = int((time.time() - enqueued_at) * 1000)
        try:
            stream = infer_request_decoder.decode(qmsg.data).stream
        except (msgspec.DecodeError, msgspec.ValidationError):
            stream = False
        await svc.reply_error(qmsg, queue_expired(waited_ms), stream)

    def cancelled(self, qmsg: QueuedMsg) -> bool:
        svc = self.svc
        request_id = qmsg.headers.get(subjects.H_REQUEST_ID, "")
        key = owner_key(qmsg.reply, qmsg.headers, request_id)
        if not svc.cancelled.seen(key, time.time()):
            return False
        if svc.ids is not None:  # dropped from the queue without a reply: free its id now
            svc.spawn(svc.ids.release(idclaims.queued_claim(key, qmsg.headers)))
        return True
