"""A dispatched non-streamed request's count on its node, held while the node may still be
working at it (pending) and released when it finishes."""

from __future__ import annotations

from collections.abc import Callable



from zml_router.timers import Timer, Wheel


#: Moves a node's (outstanding, pending) counts at once (``Sharing.move``: no I/O, no waiting).
Move = Callable[[str, int, int], None]


class PendingHold:
    """Counts one dispatched non-streamed request: +1 outstanding and pending now, pending -1
    after ``seconds`` (``attempt.pending_window_s``: a timer on the router's wheel, the count
    moved in its callback: no task, and no loop timer armed and cancelled per request; it may
    end one tick, 5 ms, late), the rest at :meth:`close`."""

    __slots__ = ("_move", "node_id", "pending", "_timer", "_closed")

    def __init__(self, move: Move, node_id: str, seconds: float, wheel: Wheel) -> None:
        self._move = move
        self.node_id = node_id
        self.pending = True
        self._closed = False
        move(node_id, 1, 1)
        self._timer: Timer | None = wheel.call_at(wheel.running_loop().time() + max(0.0, seconds), self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.pending:
            self.pending = False
            self._move(self.node_id, 0, -1)

    def close(self) -> None:
        """The request finished (reply, error or cancel): the rest of its count (once)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._closed:
            self._closed = True
            still, self.pending = self.pending, False
            self._move(self.node_id, -1, -1 if still else 0)
