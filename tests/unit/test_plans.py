"""Plan arithmetic (zmlcore.access.plans): sliding one-minute windows, concurrency leases, tokens."""

from __future__ import annotations

import pytest

from zmlcore.errors import BadRequestError
from zmlcore.messages.keys import LimitState, PlanLimits
from zmlcore.access.plans import PLANS, admit, plan_limits, release

T0 = 1_000_040.0  # 20 s into a one-minute window (1_000_020 is a window start)


def _run(limits: PlanLimits, n: int, now: float, state: LimitState | None = None) -> tuple[LimitState, int]:
    state = state or LimitState()
    ok = 0
    for i in range(n):
        new, v = admit(state, limits, now=now, lease_id=f"r{i}", lease_s=30)
        if new is not None:
            state, ok = new, ok + 1
            assert v.ok
        else:
            assert not v.ok and v.retry_after_s > 0
    return state, ok


def test_presets_match_the_api_reference() -> None:
    assert PLANS["maker"] == PlanLimits(requests_per_minute=60, concurrent=5)
    assert PLANS["team"] == PlanLimits(requests_per_minute=600, concurrent=50)
    assert plan_limits("team", tokens_per_minute=9000).tokens_per_minute == 9000
    assert plan_limits("custom", requests_per_minute=7) == PlanLimits(requests_per_minute=7)
    with pytest.raises(BadRequestError):
        plan_limits("enterprise")


def test_a_minute_admits_the_rate_and_no_more() -> None:
    limits = PlanLimits(requests_per_minute=60)
    state, ok = _run(limits, 100, T0)
    assert ok == 60
    # The next window still counts the previous one, weighted by its overlap.
    _, ok_later = _run(limits, 100, T0 + 60, state)  # 20 s into the next window: 2/3 of 60 still count
    assert ok_later == 20


def test_remaining_and_reset_headers() -> None:
    new, v = admit(LimitState(), PlanLimits(requests_per_minute=10), now=T0, lease_id="a", lease_s=5)
    assert v.ok and v.requests_limit == 10 and v.requests_remaining == 9 and 0 < v.requests_reset_s <= 120


def test_concurrency_leases() -> None:
    limits = PLANS["maker"]
    state, ok = _run(limits, 8, T0)
    assert ok == 5
    _, v = admit(state, limits, now=T0, lease_id="x", lease_s=30)
    assert not v.ok and v.reason == "concurrent"
    state = release(state, now=T0 + 1, lease_id="r0", tokens=10)
    new, v = admit(state, limits, now=T0 + 1, lease_id="y", lease_s=30)
    assert v.ok and new is not None and "y" in new.leases
    # A lease whose gateway died expires on its own.
    new2, v = admit(state, limits, now=T0 + 31, lease_id="z", lease_s=30)
    assert v.ok and new2 is not None and set(new2.leases) == {"z"}


def test_tokens_per_minute() -> None:
    limits = PlanLimits(tokens_per_minute=100)
    state, v = admit(LimitState(), limits, now=T0, lease_id="a", lease_s=5)
    assert state is not None and v.tokens_limit == 100 and v.tokens_remaining == 100
    state = release(state, now=T0, lease_id="a", tokens=120)
    new, v = admit(state, limits, now=T0 + 1, lease_id="b", lease_s=5)
    assert new is None and v.reason == "tokens" and v.retry_after_s > 0 and v.tokens_remaining == 0


def test_old_windows_are_forgotten() -> None:
    limits = PlanLimits(requests_per_minute=5)
    state, _ = _run(limits, 5, T0)
    _, ok = _run(limits, 10, T0 + 180, state)
    assert ok == 5
