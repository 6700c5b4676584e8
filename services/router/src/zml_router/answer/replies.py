"""What the requester receives of a request, on the router's one publisher: replies, stream
messages, error replies, "queued" keepalives."""

from __future__ import annotations

import logging
import time

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.bus.publish import Publisher
from zmlcore.errors import ZMLError
from zmlcore.reply.keepalive import QUEUED, KeepaliveBook, keepalive_headers

from zml_router.incoming import Incoming
from zml_router.replicas.ids import RequestIds
from zml_router.replicas.limits import IdentityLimits

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode


class Replies:
    """What the requester receives, on the router's one publisher (one write per loop
    iteration): replies and stream messages, error replies, "queued" keepalives. The last reply
    of a request frees first what the caller may reuse the moment it has it: the request id's
    claim (``zml_router.replicas.ids``) and the plan's concurrency slot (``zml_router.replicas.limits``), both of
    the request this task handles."""

    def __init__(self, keepalives: KeepaliveBook, ids: RequestIds, limits: IdentityLimits) -> None:
        self.keepalives = keepalives
        self.ids = ids
        self.limits = limits
        self.nc: NATS | None = None
        self.pub: Publisher | None = None

    def start(self, nc: NATS) -> None:
        self.nc = nc
        self.pub = Publisher.of(nc)

    async def publish(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        if reply and self.pub is not None:
            await self.pub.publish(reply, data, headers=headers)
            if self.keepalives:  # the next keepalive is an interval after this message
                self.keepalives.sent(reply, time.monotonic())

    async def before_last(self, tokens: int) -> None:
        """Free the request's id claim and plan slot (on every replica): its last reply follows."""
        await self.ids.release_current()
        await self.limits.release_current(tokens)

    async def queued(self, reply: str) -> None:
        """Tell a requester that asked for keepalives that its request waits in the saturation
        queue (it stops watching for keepalives meanwhile)."""
        self.keepalives.remove(reply)
        await self.publish(reply, b"", keepalive_headers(QUEUED))

    async def error(self, msg: Incoming, exc: ZMLError, stream: bool) -> None:
        headers = {subjects.H_ERROR_CODE: exc.code, **getattr(exc, "nats_headers", {})}
        if exc.retry_after is not None:
            headers[subjects.H_RETRY_AFTER] = f"{exc.retry_after:g}"
        if stream:
            headers[subjects.H_STREAM] = subjects.STREAM_ERROR
        try:
            await self.ids.release_current()
            await self.publish(msg.reply, _encode(exc.to_body()), headers)
        except Exception:  # connection closing: the requester times out on its side
            log.warning("could not send error reply %s", exc.code)
