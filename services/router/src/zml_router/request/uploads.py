"""A request body larger than one NATS message (audio, a long prompt), fetched from its requester in parts.

The request arrives with an empty body and ``Zml-Upload-Bytes``; this router asks for the body
on the request's reply subject (``Zml-Upload-To: zml.upload.<router id>.<token>``, a random
token that only the requester sees) and collects the parts its requester then publishes there,
in order, with bigreply's :class:`~zmlcore.reply.bigreply.Collector` (the same numbering as a
reply in parts). One subscription per router (``zml.upload.<router id>.*``); a part for a token
nobody waits for is dropped.

Why parts through the router and not a JetStream object store: as for replies
(zmlcore.reply.bigreply), the reply inbox is private to the requester, so only it learns where
to send, nothing is left behind when either side dies, and no identity needs access to a
bucket where it could read another's audio. A requester whose router dies mid-upload sends the
request again (zmlcore.reply.exchange) and uploads it again to the next router.

    body = await uploads.collect(msg.reply, size, timeout_s)   # UploadIncompleteError, ...
"""

from __future__ import annotations

import asyncio
import os

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.bus.publish import publish
from zmlcore.errors import BadRequestError, ReplyIncompleteError, ReplyTooLargeError, RequestTooLargeError
from zmlcore.errors import UploadIncompleteError
from zmlcore.reply.bigreply import PART_WAIT_S, Collector

__all__ = ["Uploads", "upload_size"]


def upload_size(headers: dict[str, str] | None, limit: int) -> int | None:
    """The body size a request announces (``Zml-Upload-Bytes``), None for a request that carries
    its body; BadRequestError / RequestTooLargeError for a size that is not one or over ``limit``."""
    value = (headers or {}).get(subjects.H_UPLOAD_BYTES)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and 0 < len(value) <= 15) or int(value) == 0:
        raise BadRequestError(f"{subjects.H_UPLOAD_BYTES} must be a positive integer")
    if int(value) > limit:
        setting = "[defaults] max_audio_bytes" if subjects.H_AUDIO in (headers or {}) else "[gateway] max_body_bytes"
        raise RequestTooLargeError(f"request body of {int(value)} bytes is over the limit of {limit} bytes ({setting})")
    return int(value)


class Uploads:
    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self.nc: NATS | None = None
        self._sub: Subscription | None = None
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}

    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self._sub = await nc.subscribe(subjects.upload(self.router_id), cb=self._on_part)

    async def _on_part(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:
            queue.put_nowait(msg)

    async def collect(self, reply: str, size: int, first_s: float) -> bytes:
        """Ask the requester on ``reply`` for the body of ``size`` bytes and return it; the first
        part is due within ``first_s`` (the request's time), each next one within PART_WAIT_S."""
        if self.nc is None or not reply:
            raise BadRequestError("a request uploaded in parts needs a reply subject to be asked on")
        token = os.urandom(16).hex()
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = queue
        collector = Collector(size)
        try:
            await publish(self.nc, reply, b"", headers={subjects.H_UPLOAD_TO: subjects.upload(self.router_id, token)})
            wait = min(first_s, PART_WAIT_S)
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    got = f"part {collector.next} of {collector.n}" if collector.started else "its first part"
                    raise UploadIncompleteError(f"the request's body was announced as {size} bytes in parts, and "
                                                f"{got} did not arrive within {wait:g} s; retry",
                                                retry_after=1.0) from None
                wait = PART_WAIT_S
                try:
                    body = collector.feed(msg.data, msg.headers)
                except ReplyTooLargeError:
                    raise RequestTooLargeError(f"the uploaded body is over its announced {size} bytes") from None
                except ReplyIncompleteError as exc:
                    raise UploadIncompleteError(f"the request's body {exc.message.split(' of the reply', 1)[0]} "
                                                "was lost on its way (or sent out of order); retry",
                                                retry_after=1.0) from None
                if body is not None:
                    if len(body) != size:
                        raise UploadIncompleteError(f"the uploaded body is {len(body)} bytes, not the {size} "
                                                    "announced; retry", retry_after=1.0)
                    return body
        finally:
            del self._waiting[token]

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
