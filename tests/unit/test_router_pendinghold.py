"""A non-streamed request counts as pending until its estimated first token, not its reply."""

from __future__ import annotations

import asyncio

import pytest

from zmlcore.messages import NodeState
from zmlcore.policy.estimate import NONSTREAM_PENDING_FOR, estimate_ttft
from zml_router.pendinghold import PendingHold, window_s


class Counts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, node_id: str, outstanding: int, pending: int) -> None:
        self.calls.append((node_id, outstanding, pending))


async def test_pending_ends_at_the_window_and_the_rest_at_close() -> None:
    c = Counts()
    hold = PendingHold(c, "n1", 0.05)
    assert c.calls == [("n1", 1, 1)]
    await asyncio.sleep(0.3)
    assert c.calls == [("n1", 1, 1), ("n1", 0, -1)]
    hold.close()
    assert c.calls[-1] == ("n1", -1, 0)
    assert sum(o for _n, o, _p in c.calls) == 0 and sum(p for _n, _o, p in c.calls) == 0


async def test_a_reply_before_the_window_ends_everything_once() -> None:
    c = Counts()
    hold = PendingHold(c, "n1", 0.2)
    hold.close()
    hold.close()  # a second close (error path after a reply) counts nothing more
    await asyncio.sleep(0.4)  # the timer was cancelled: no late decrement
    assert c.calls == [("n1", 1, 1), ("n1", -1, -1)]


def test_window_is_the_estimate_for_the_body() -> None:
    st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    # 4,000 bytes ~ 1,000 prompt tokens: 0.1 s on an idle H100, plus 2 pending prefills ahead
    assert window_s(st, 2, 2, 4000) == pytest.approx(NONSTREAM_PENDING_FOR * estimate_ttft(st, 2, 2, 1000))
    assert window_s(st, 0, 0, 4000) == pytest.approx(NONSTREAM_PENDING_FOR * 0.1)
