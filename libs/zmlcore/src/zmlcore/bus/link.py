"""What a service needs to know about its NATS connection beyond nats-py's client.

nats-py re-subscribes core subscriptions after a reconnect, but JetStream consumers (the ordered
consumers behind KV watches, pull consumers) live in the server and are gone after a broker
restart or the loss of the server that held them. Whoever owns one waits on
:meth:`Link.reconnected` and re-creates it. A connection closed for good (nats-py gives up after
some ``-ERR`` replies, e.g. a message over ``max_payload``) sets :attr:`Link.closed`, and the
runner exits non-zero so that the supervisor restarts the service.

    link = link_of(nc)
    gen = link.generation
    await link.reconnected(gen)      # returns once the connection has come back after ``gen``

A request in flight that must hear of a reconnect (zmlcore.reply.exchange) registers itself with
:meth:`Link.follow` and is told by a method call: no callback, task or reference cycle is made
per request.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Protocol

from nats.aio.client import Client as NATS


def split_urls(urls: str | Sequence[str]) -> list[str]:
    """``"nats://a:4222,nats://b:4222"`` or a list of them -> the list of broker URLs."""
    items = [urls] if isinstance(urls, str) else list(urls)
    out = [u.strip() for item in items for u in item.split(",") if u.strip()]
    if not out:
        raise ValueError("no NATS URL given")
    return out


class Follower(Protocol):
    def link_changed(self, link: Link) -> None:
        """The connection came back, or (``link.closed`` set) closed for good."""


class Link:
    """Connection events of one client: a generation counter bumped on every reconnect, and
    a ``closed`` flag set once the client has stopped for good."""

    def __init__(self, replicas: int = 1) -> None:
        #: JetStream replicas for every bucket and stream this service creates.
        self.replicas = replicas
        self.generation = 0
        self.closed = asyncio.Event()
        #: Set by the service's own shutdown, so a deliberate close is not a failure.
        self.closing = False
        self._changed = asyncio.Event()
        self._followers: set[Follower] = set()

    def bump(self) -> None:
        self.generation += 1
        self._changed.set()
        self._changed = asyncio.Event()
        self._fire()

    def mark_closed(self) -> None:
        self.closed.set()
        self._changed.set()
        self._fire()

    def follow(self, follower: Follower) -> None:
        """``follower.link_changed(self)`` at every reconnect and at the close, until
        :meth:`unfollow`. A set entry per follower: a request in flight (thousands a second)
        makes no closure for it, and nothing of it is left for the garbage collector."""
        self._followers.add(follower)

    def unfollow(self, follower: Follower) -> None:
        self._followers.discard(follower)

    def _fire(self) -> None:
        for follower in tuple(self._followers):  # one may unfollow while told
            follower.link_changed(self)

    async def reconnected(self, since: int) -> None:
        """Wait until a reconnect after generation ``since`` (or the connection closing)."""
        while self.generation == since and not self.closed.is_set():
            await self._changed.wait()


_links: "weakref.WeakKeyDictionary[NATS, Link]" = weakref.WeakKeyDictionary()


def register(nc: NATS, link: Link) -> None:
    _links[nc] = link


def link_of(nc: NATS) -> Link:
    """The Link of a client made by :func:`zmlcore.bus.connect.connect`; a fresh one (no events ever
    fire: watches still recover through their own liveness checks) for any other client."""
    link = _links.get(nc)
    if link is None:
        link = _links[nc] = Link()
    return link
