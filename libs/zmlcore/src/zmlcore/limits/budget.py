"""A bound on bytes held at once by one process (audio bodies in the gateway and the routers):
pure, no I/O, no waiting. A request that would pass it is refused (QUEUE_FULL, retry shortly)
rather than queued: its bytes are already in memory, or on their way.

    budget = ByteBudget(1 << 30)
    if not budget.take(len(body)):
        raise QueueFullError(...)
    try:
        ...
    finally:
        budget.give(len(body))
"""

from __future__ import annotations

__all__ = ["ByteBudget"]


class ByteBudget:
    __slots__ = ("limit", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes if they fit (True), else hold nothing (False)."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        """Release ``n`` bytes taken before."""
        self.held = max(0, self.held - n)
