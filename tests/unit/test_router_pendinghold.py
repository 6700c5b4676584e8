"""A non-streamed request counts as pending until its estimated first token, not its reply."""

from __future__ import annotations

import asyncio

import pytest

from zmlcore.messages import NodeState
from zmlcore.policy.estimate import NONSTREAM_PENDING_FOR, estimate_ttft
from zml_router.node.attempt import pending_window_s
from zml_router.node.pending import PendingHold
from zml_router.timers import Wheel


class Counts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, node_id: str, outstanding: int, pending: int) -> None:
        self.calls.append((node_id, outstanding, pending))


async def test_pending_ends_at_the_window_and_the_rest_at_close() -> None:
    c = Counts()
    wheel = Wheel()
    hold = PendingHold(c, "n1", 0.05, wheel)
    assert c.calls == [("n1", 1, 1)]
    await asyncio.sleep(0.3)
    assert c.calls == [("n1", 1, 1), ("n1", 0, -1)]
    hold.close()
    assert c.calls[-1] == ("n1", -1, 0)
    assert sum(o for _n, o, _p in c.calls) == 0 and sum(p for _n, _o, p in c.calls) == 0


async def test_a_reply_before_the_window_ends_everything_once() -> None:
    c = Counts()
    wheel = Wheel()
    hold = PendingHold(c, "n1", 0.2, wheel)
    hold.close()
    hold.close()  # a second close (error path after a reply) counts nothing more
    await asyncio.sleep(0.4)  # the timer was cancelled: no late decrement
    assert c.calls == [("n1", 1, 1), ("n1", -1, -1)]
    assert len(wheel) == 0  # nothing left armed


async def test_holds_arm_no_loop_timer_of_their_own() -> None:
    """A hold is an entry on the router's wheel: 100 of them, each closed before its window
    ends, leave one loop timer (the wheel's) instead of arming and cancelling 100."""
    loop = asyncio.get_running_loop()
    armed = []
    call_at, call_later = loop.call_at, loop.call_later

    def counting_at(when: float, cb: object, *args: object) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, cb, *args)  # type: ignore[arg-type]

    def counting_later(delay: float, cb: object, *args: object) -> asyncio.TimerHandle:
        armed.append(delay)
        return call_later(delay, cb, *args)  # type: ignore[arg-type]

    loop.call_at, loop.call_later = counting_at, counting_later  # type: ignore[method-assign]
    try:
        wheel = Wheel()
        c = Counts()
        for _ in range(100):
            PendingHold(c, "n1", 0.5, wheel).close()
    finally:
        del loop.call_at, loop.call_later  # type: ignore[attr-defined]
    assert len(armed) <= 2, len(armed)
    assert sum(p for _n, _o, p in c.calls) == 0


def test_window_is_the_estimate_for_the_body() -> None:
    st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    # 4,000 bytes ~ 1,000 prompt tokens: 0.1 s on an idle H100, plus 2 pending prefills ahead
    assert pending_window_s(st, 2, 2, 4000) == pytest.approx(NONSTREAM_PENDING_FOR * estimate_ttft(st, 2, 2, 1000))
    assert pending_window_s(st, 0, 0, 4000) == pytest.approx(NONSTREAM_PENDING_FOR * 0.1)
