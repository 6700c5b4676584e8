"""zmlcore.reply.norouter: when a request that found no router is sent again, and when it gives up (pure)."""

from __future__ import annotations

import doctest

import pytest

from zmlcore.reply import norouter
from zmlcore.reply.norouter import BACKOFF_S, NoRouterWait, is_no_responders


def test_doctests() -> None:
    assert doctest.testmod(norouter).failed == 0


def run(wait: NoRouterWait, start: float, deadline: float) -> list[float]:
    """The delays a requester waits when every send finds no router (sends take no time)."""
    now, out = start, []
    while (d := wait.delay(now, deadline)) is not None:
        assert d > 0
        out.append(d)
        now += d
    return out


def test_backoff_grows_then_repeats_and_ends_exactly_at_the_grace() -> None:
    delays = run(NoRouterWait(grace_s=2.0), start=100.0, deadline=1e9)
    assert delays[:4] == list(BACKOFF_S)
    assert set(delays[4:-1]) == {BACKOFF_S[-1]}
    assert sum(delays) == pytest.approx(2.0)
    # Bounded: a dead fleet costs the broker ~20 sends per request over a 2 s grace, not a spin.
    assert len(delays) <= 4 + 2.0 / BACKOFF_S[-1]


def test_the_request_deadline_caps_the_grace() -> None:
    delays = run(NoRouterWait(grace_s=2.0), start=0.0, deadline=0.3)
    assert sum(delays) == pytest.approx(0.3)


def test_grace_counts_from_the_first_no_responders_not_from_the_request() -> None:
    w = NoRouterWait(grace_s=0.5)
    assert w.delay(10.0, deadline=100.0) == BACKOFF_S[0]
    assert w.delay(10.49, deadline=100.0) == pytest.approx(min(BACKOFF_S[1], 0.01))
    assert w.delay(10.5, deadline=100.0) is None


@pytest.mark.parametrize(("grace", "deadline"), [(0.0, 100.0), (2.0, 0.0), (2.0, -1.0)])
def test_no_grace_or_no_time_left_gives_up_at_once(grace: float, deadline: float) -> None:
    assert NoRouterWait(grace).delay(0.0, deadline) is None


def test_a_late_waker_gets_no_extra_time() -> None:
    w = NoRouterWait(grace_s=1.0)
    w.delay(0.0, deadline=100.0)
    assert w.delay(5.0, deadline=100.0) is None  # an event loop that overslept: over, not another try


@pytest.mark.parametrize(("headers", "data", "expected"), [
    ({"Status": "503"}, b"", True),
    ({"Status": "503", "Description": "No Responders"}, b"", True),
    ({"Status": "503"}, b"{}", False),  # a body: some router's (error) reply, not the broker's status
    ({"Status": "408"}, b"", False),
    ({"Zml-Keepalive": "alive"}, b"", False),
    (None, b"", False),
    ({}, b"", False),
])
def test_is_no_responders(headers: dict[str, str] | None, data: bytes, expected: bool) -> None:
    assert is_no_responders(headers, data) is expected
