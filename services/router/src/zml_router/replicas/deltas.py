"""In-flight deltas to the peer replicas, summed per node over a short window.

Every request moved this replica's counts two or three times (start, first token, end), and
each move was a ``zml.inflight`` message fanned out to every replica, on the request's path.
Summed per node for ``WINDOW_S``, a request that starts and ends within the window sends
nothing at all, and a busy node gets one message per window instead of one per move; the
request path only adds to a dict. Peers see the counts up to a window late (the routing
simulator's replica-lag runs: 1-5 ms of lag stays within the routing targets), and the 1 s
snapshot still repairs anything lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.messages import InflightDelta
from zmlcore.bus.publish import Publisher

log = logging.getLogger("zml.router")

#: How long a node's moves are summed before they go to the peers.
WINDOW_S = 0.002

_encode = msgspec.json.encode


class DeltaWindow:
    def __init__(self, nc: NATS, router_id: str, window_s: float = WINDOW_S) -> None:
        self.nc = nc
        self.pub = Publisher.of(nc)
        self.router_id = router_id
        self.window_s = window_s
        #: node id -> [outstanding, pending] moved since the last send (bounded by the fleet).
        self._moves: dict[str, list[int]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Future[None] | None = None

    def add(self, node_id: str, outstanding: int, pending: int) -> None:
        m = self._moves.get(node_id)
        if m is None:
            self._moves[node_id] = [outstanding, pending]
        else:
            m[0] += outstanding
            m[1] += pending
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._due)

    def _take(self) -> list[bytes]:
        moves, self._moves = self._moves, {}
        ts = time.time()
        return [_encode(InflightDelta(router_id=self.router_id, node_id=n, outstanding=o, pending=p, ts=ts))
                for n, (o, p) in moves.items() if o or p]

    def _due(self) -> None:
        self._timer = None
        deltas = self._take()
        if deltas and self.nc.is_connected:
            self._sending = asyncio.ensure_future(self._send(deltas, self._sending))

    async def _send(self, deltas: list[bytes], before: asyncio.Future[None] | None = None) -> None:
        if before is not None and not before.done():
            await before  # in order: a peer adds deltas up
        for data in deltas:
            try:
                await self.pub.publish(subjects.INFLIGHT, data)  # buffered: one write for all
            except Exception:  # the next snapshot repairs a peer's counts
                log.debug("in-flight delta not published", exc_info=True)

    async def then(self, subject: str, make: Callable[[], bytes]) -> None:
        """Publish ``make()`` (a snapshot of the counts) in order with the deltas: what was
        summed before it is read goes before it, what moves after goes after it, so that a peer
        never adds a move the snapshot already counts."""
        prev = self._sending
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sending = mine  # deltas summed from now on wait for this
        try:
            if prev is not None and not prev.done():
                await prev
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            deltas, last = self._take(), make()  # the same instant
            await self._send(deltas)
            await self.pub.publish(subject, last)
        finally:
            mine.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._moves.clear()
