"""Subscriptions whose messages nats-py's reader hands over itself, in the order they come off
the socket, across subscriptions too.

A callback subscription gets a task of its own: a task switch per message, and two subjects'
messages applied in whatever order their tasks run (one task drains its queue before the
other's runs). Where a message is a quick, non-blocking update of shared state (a reply into
its exchange; a peer's in-flight delta or snapshot) or is handed to a task of its own anyway (a
request reaching a router), ``deliver`` runs in the reader instead."""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore.bus import natsinternals


async def subscribe_direct(nc: NATS, subject: str, deliver: Callable[[Msg], None], queue: str = "") -> Subscription:
    """Subscribe ``deliver(msg)`` (which must not raise or block) to ``subject`` (in queue group
    ``queue``, if given); without direct delivery in this nats-py (said at start-up), a
    callback subscription."""
    sub = await nc.subscribe(subject, queue=queue)
    if natsinternals.deliver_directly(sub, deliver):
        return sub
    await sub.unsubscribe()

    async def cb(msg: Msg) -> None:
        deliver(msg)

    return await nc.subscribe(subject, queue=queue, cb=cb)
