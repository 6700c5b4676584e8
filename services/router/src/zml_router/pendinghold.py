"""How long a non-streamed request counts as ``pending`` (not yet at its first token).

A plain reply shows the router no first token, so counting it pending until completion made a
node look prefill-bound through every such request's decode (benches/routing_sim.py: 1.14x the
oracle's p99 at 80% load instead of 1.00x). Instead its pending count ends when the TTFT the
policy estimated for it has passed (``zmlcore.policy.estimate.nonstream_pending_s``), or at
completion if that comes first. The simulator models exactly this (``--pending-expiry``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from zmlcore.messages import NodeState
from zmlcore.policy.estimate import nonstream_pending_s, prompt_tokens_from_body

Count = Callable[[str, int, int], Awaitable[None]]


def window_s(st: NodeState, outstanding: int, pending: int, body_bytes: int) -> float:
    """The hold for a request of ``body_bytes`` about to go to a node with these counters."""
    return nonstream_pending_s(st, outstanding, pending, prompt_tokens_from_body(body_bytes))


class PendingHold:
    """Counts one dispatched non-streamed request: +1 outstanding and pending now, pending -1
    after ``seconds``, the rest at :meth:`close`. Use ``await PendingHold.start(...)``."""

    def __init__(self, count: Count, node_id: str) -> None:
        self._count = count
        self.node_id = node_id
        self.pending = True
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, count: Count, node_id: str, seconds: float) -> PendingHold:
        hold = cls(count, node_id)
        await count(node_id, 1, 1)
        hold._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), hold._expire)
        return hold

    def _expire(self) -> None:
        if self.pending:
            self.pending = False
            self._task = asyncio.ensure_future(self._count(self.node_id, 0, -1))

    async def close(self) -> None:
        """The request finished (reply, error or cancel): the rest of its count."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            await self._task  # keep the deltas in order for the peers
        still, self.pending = self.pending, False
        await self._count(self.node_id, -1, -1 if still else 0)
