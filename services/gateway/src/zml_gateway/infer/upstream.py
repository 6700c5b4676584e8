"""The gateway's side of the NATS request: the :class:`~zmlcore.reply.exchange.Exchange` an
admitted request becomes, what aborts it while it runs (the HTTP client going away, the broker
connection lost), its cancel, and the wait for a broker that is reconnecting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.access.identity import config_owner
from zmlcore.bus.publish import publish
from zmlcore.bus.link import Link, link_of
from zmlcore.config import ZMLConfig
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.reply.exchange import Exchange, parts_buffer
from zml_gateway.asgi import Headers, Receive


@dataclass(slots=True)
class Outbound:
    """One admitted inference request on its way to the routers."""

    body: bytes
    #: NATS headers: ZML's fields, request id, timeout, owner (zml_gateway.owners.InFlight)
    headers: dict[str, str]
    request_id: str
    timeout: float
    #: x-ratelimit-* headers the answer carries
    limits: Headers
    #: tokens the answer used (plan limits): set before its last message goes out
    tokens: int = 0


class ClientGone(Exception):
    """The HTTP client went away while its request ran (an Exchange abort)."""


class BrokerLost(Exception):
    """The broker connection was lost while a request ran (an Exchange abort)."""


class Upstream:
    def __init__(self, cfg: ZMLConfig, nc: NATS) -> None:
        self.cfg = cfg
        self.nc = nc
        self.owner = config_owner(cfg.nats)  # this gateway's NATS identity: its cancel subjects
        self._link: Link | None = None  # the connection's Link, looked up once (link_of is a weak-dict lookup)

    @property
    def link(self) -> Link:
        if self._link is None:
            self._link = link_of(self.nc)
        return self._link

    def exchange(self, out: Outbound, buffer: int | None = None) -> Exchange:
        """The request to the routers: keepalives asked for, a dead router's request sent again
        (and one that found no router, within [gateway] no_router_grace_s: zmlcore.reply.norouter),
        a dead router's stream continued from what it relayed (zmlcore.reply.resume);
        a plain reply over max_payload collected in parts (``buffer`` None: room for all of them)."""
        g = self.cfg.gateway
        ka = g.router_keepalive_ms
        limit = self.cfg.nats.max_reply_bytes
        return Exchange(self.nc, out.body, out.headers, timeout_s=out.timeout, wait_s=out.timeout + 1.0,
                        subject=subjects.FRONT_DOOR_INFER, keepalive_s=ka / 1000.0 if ka else None,
                        accept_parts=None if buffer else limit,
                        buffer=buffer or parts_buffer(limit, self.nc.max_payload),
                        no_router_grace_s=g.no_router_grace_s,
                        resume=bool(buffer))  # a stream: continued by another router if its own dies

    def watch(self, ex: Exchange, receive: Receive) -> Callable[[], None]:
        """While a request runs, the HTTP client going away aborts its exchange, and so does the
        broker connection closing for good; a broker connection that comes back has the
        request sent again (Exchange.follow: a stream continued from what it relayed). The
        broker is a callback; the client is one too when the server offers it
        (zml_gateway.protocol.FastCycle.on_disconnect, HTTP/1.1), else a task waits on
        ``receive()``. Returns what stops watching."""
        unwatch = ex.follow(self.link, BrokerLost)
        on_disconnect = getattr(getattr(receive, "__self__", None), "on_disconnect", None)
        if on_disconnect is not None:  # no task (created, run, cancelled) per request
            off = on_disconnect(lambda: ex.abort(ClientGone()))

            def stop_hook() -> None:
                off()
                unwatch()
            return stop_hook

        async def client_gone() -> None:
            try:
                await receive()  # the body was read whole: what comes next is the disconnect
            except Exception:
                pass
            ex.abort(ClientGone())

        task = asyncio.ensure_future(client_gone())

        def stop() -> None:
            task.cancel()
            unwatch()
        return stop

    async def cancel(self, out: Outbound) -> None:
        await publish(self.nc, subjects.cancel(out.request_id, self.owner), b"",
                              headers={subjects.H_OWNER: out.headers[subjects.H_OWNER]})

    async def await_broker(self, timeout: float) -> float:
        """A request that arrives while the broker connection is down has reached nobody, so it
        waits for the reconnect (a broker restarted: a few seconds) within [gateway]
        broker_grace_s and never past its own timeout, then goes on with the time left.
        Past that: 503 CONNECTION_FAILED, as before. It is not published while disconnected:
        nats-py would buffer it, and a buffer lost with the connection would lose it silently."""
        t0 = time.monotonic()
        grace = min(self.cfg.gateway.broker_grace_s, timeout)
        link = self.link
        if grace > 0:
            try:
                async with asyncio.timeout(grace):
                    while not self.nc.is_connected and not link.closed.is_set():
                        await link.reconnected(link.generation)
            except asyncio.TimeoutError:
                pass
        if not self.nc.is_connected:
            raise ZMLConnectionError("the gateway has lost its broker connection; retry", retry_after=1.0)
        return timeout - (time.monotonic() - t0)
