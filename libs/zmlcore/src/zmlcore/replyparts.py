"""Request-reply where the reply may come in parts (zmlcore.bigreply): the NATS side.

:func:`publish_reply` is the router's: one message, or the parts of a reply over max_payload.
:class:`PartsRequester` is the gateway's and the SDK's: like ``nc.request`` (one wildcard
subscription on the connection's own inbox, a token per request, no SUB per request) but it
declares ``Zml-Accept-Parts`` and collects every part before it returns.

    requester = PartsRequester(nc, max_bytes=64 << 20)
    reply = await requester.request("zml.infer", body, headers, timeout=30)
    reply.data, reply.headers

Errors are those of ``nc.request`` (``nats.errors.NoRespondersError``, ``nats.errors.TimeoutError``)
so callers keep their one translation, plus REPLY_INCOMPLETE / REPLY_TOO_LARGE (ZML errors).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.bigreply import PART_WAIT_S, Collector, plan
from zmlcore.errors import ZMLError

#: nats-py puts the broker's status line (503: no responders) in this header.
_STATUS = "Status"


async def publish_reply(nc: NATS, reply: str, data: bytes, headers: dict[str, str], accept: int | None) -> None:
    """Publish a finished reply (raises ReplyTooLargeError, before sending anything, when the
    requester cannot receive it: the caller answers with that error instead)."""
    for part, h in plan(data, headers, nc.max_payload, accept):
        await nc.publish(reply, part, headers=h)  # nats-py flushes when its buffer is full


@dataclass(slots=True)
class Reply:
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


class _Pending:
    __slots__ = ("collector", "future", "last")

    def __init__(self, max_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.collector = Collector(max_bytes)
        self.future: asyncio.Future[Reply] = loop.create_future()
        self.last = loop.time()


class PartsRequester:
    """``nc.request`` for replies that may come in parts; one per connection."""

    def __init__(self, nc: NATS, max_bytes: int) -> None:
        self.nc = nc
        self.max_bytes = max_bytes
        self._prefix = ""
        self._sub: Subscription | None = None
        self._lock = asyncio.Lock()
        self._tokens = itertools.count()
        self._waiting: dict[str, _Pending] = {}

    async def _ensure(self) -> str:
        if self._sub is None:
            async with self._lock:
                if self._sub is None:
                    prefix = self.nc.new_inbox()  # under the identity's own inbox prefix
                    self._sub = await self.nc.subscribe(f"{prefix}.*", cb=self._on_msg)
                    self._prefix = prefix
        return self._prefix

    async def _on_msg(self, msg: Msg) -> None:
        p = self._waiting.get(msg.subject[len(self._prefix) + 1:])
        if p is None or p.future.done():
            return
        p.last = asyncio.get_running_loop().time()
        headers = msg.headers or {}
        if headers.get(_STATUS) == "503":
            p.future.set_exception(nats.errors.NoRespondersError())
            return
        try:
            body = p.collector.feed(msg.data, headers)
        except ZMLError as exc:
            p.future.set_exception(exc)
            return
        if body is not None:
            p.future.set_result(Reply(body, p.collector.headers))

    async def request(self, subject: str, payload: bytes, headers: dict[str, str] | None, timeout: float) -> Reply:
        prefix = await self._ensure()
        loop = asyncio.get_running_loop()
        token = str(next(self._tokens))
        p = _Pending(self.max_bytes, loop)
        self._waiting[token] = p
        try:
            await self.nc.publish(subject, payload, reply=f"{prefix}.{token}",
                                  headers={**(headers or {}), subjects.H_ACCEPT_PARTS: str(self.max_bytes)})
            deadline = loop.time() + timeout
            while True:
                now = loop.time()
                if now >= deadline:
                    raise nats.errors.TimeoutError
                # Between parts, a lost one must not hold the caller for the whole timeout.
                await asyncio.wait((p.future,), timeout=min(deadline - now, PART_WAIT_S))
                if p.future.done():
                    return p.future.result()
                if p.collector.started and loop.time() - p.last >= PART_WAIT_S:
                    raise p.collector.lost()
        finally:
            self._waiting.pop(token, None)
            if not p.future.done():
                p.future.cancel()
            elif not p.future.cancelled():
                p.future.exception()  # retrieved, also when the caller was cancelled meanwhile
