"""Replies that may come in parts (zmlcore.reply.bigreply): the NATS side.

:func:`publish_reply` is the router's: one message, or the parts of a reply over max_payload.
The gateway and the SDK collect them in :meth:`zmlcore.reply.exchange.Exchange.reply` (which also
declares ``Zml-Accept-Parts``), into a :class:`Reply`. :data:`PART_WAIT_S` is how long the next
part may take there before the reply counts as incomplete (REPLY_INCOMPLETE, retryable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from zmlcore.reply.bigreply import PART_WAIT_S, plan
from zmlcore.bus.publish import Publisher

__all__ = ["PART_WAIT_S", "Reply", "publish_reply"]


async def publish_reply(nc: NATS, reply: str, data: bytes, headers: dict[str, str], accept: int | None) -> None:
    """Publish a finished reply (raises ReplyTooLargeError, before sending anything, when the
    requester cannot receive it: the caller answers with that error instead)."""
    pub = Publisher.of(nc)
    for part, h in plan(data, headers, nc.max_payload, accept):
        await pub.publish(reply, part, headers=h)  # bounded: a forced flush past pending_size


@dataclass(slots=True)
class Reply:
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
