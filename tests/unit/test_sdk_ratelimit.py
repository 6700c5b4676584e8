"""The client-side rate limiter's maths (token buckets, virtual scheduling), with a fake clock."""

from __future__ import annotations

import pytest

from zml._ratelimit import RateLimiter, parse_reset


def starts(lim: RateLimiter, n: int, tokens: int = 1, now: float = 0.0) -> list[float]:
    """When each of ``n`` requests issued at ``now`` may start."""
    return [now + lim.reserve(tokens, now) for _ in range(n)]


def test_rpm_with_default_burst_is_one_seconds_worth() -> None:
    lim = RateLimiter(rpm=120, now=0.0)  # 2/s, burst 2
    assert starts(lim, 6) == pytest.approx([0, 0, 0.5, 1.0, 1.5, 2.0])


def test_burst_of_one_spaces_evenly_and_refills() -> None:
    lim = RateLimiter(rpm=60, max_request_burst=1, now=0.0)
    assert starts(lim, 3) == pytest.approx([0, 1, 2])
    assert lim.reserve(1, 10.0) == 0.0  # idle long enough: a full (one-request) bucket


def test_tokens_per_minute_and_large_requests_wait_without_deadlock() -> None:
    lim = RateLimiter(tpm=6000, max_token_burst=100, now=0.0)  # 100 tokens/s
    assert lim.reserve(100, 0.0) == 0.0
    assert lim.reserve(50, 0.0) == pytest.approx(0.5)
    assert lim.reserve(1000, 0.0) == pytest.approx(10.5)  # bigger than the burst: waits, never stalls


def test_all_limits_at_once_the_slowest_wins() -> None:
    lim = RateLimiter(rpm=600, tpm=600, max_request_burst=1, max_token_burst=10, now=0.0)  # 10 req/s, 10 tok/s
    assert lim.reserve(10, 0.0) == 0.0
    assert lim.reserve(10, 0.0) == pytest.approx(1.0)  # tokens bind, not requests (0.1 s)


def test_day_limits() -> None:
    lim = RateLimiter(rpd=3, now=0.0)
    assert starts(lim, 3) == [0, 0, 0]
    assert lim.reserve(1, 0.0) == pytest.approx(86_400 / 3)


def test_settle_refunds_unused_tokens() -> None:
    lim = RateLimiter(tpm=6000, max_token_burst=100, now=0.0)
    lim.reserve(100, 0.0)
    lim.settle(reserved=100, actual=20, now=0.0)
    assert lim.reserve(80, 0.0) == 0.0


def test_sync_from_server_headers() -> None:
    lim = RateLimiter(rpm=600, tpm=60_000, now=0.0)
    lim.sync({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"}, 0.0)
    assert lim.reserve(1, 0.0) == pytest.approx(2.1)  # wait for the reset, plus this request's 0.1 s
    lim.sync({"x-ratelimit-remaining-tokens": "5"}, 0.0)
    assert lim.tpm is not None and lim.tpm.level == 5


def test_disabled_and_invalid() -> None:
    assert not RateLimiter().enabled and RateLimiter().reserve(1000, 0.0) == 0.0
    with pytest.raises(ValueError):
        RateLimiter(rpm=0)


@pytest.mark.parametrize(("value", "seconds"), [("1s", 1), ("6m0s", 360), ("20ms", 0.02), ("1.5", 1.5), ("x", None)])
def test_parse_reset(value: str, seconds: float | None) -> None:
    assert parse_reset(value) == (pytest.approx(seconds) if seconds is not None else None)


def test_header_bucket_scope_routes_server_headers() -> None:
    import pytest as _pytest

    from zml._ratelimit import RateLimiter as _RL

    headers = {"x-ratelimit-remaining-requests": "3"}
    minute = _RL(rpm=600, rpd=10_000, max_request_burst=100, now=0.0)
    minute.sync(headers, now=0.0)
    assert minute.rpm is not None and minute.rpd is not None
    assert minute.rpm.level == 3 and minute.rpd.level > 3
    day = _RL(rpm=600, rpd=10_000, max_request_burst=100, header_bucket_scope="day", now=0.0)
    day.sync(headers, now=0.0)
    assert day.rpm is not None and day.rpd is not None
    assert day.rpm.level == 100 and day.rpd.level == 3
    both = _RL(rpm=600, rpd=10_000, max_request_burst=100, header_bucket_scope="both", now=0.0)
    both.sync(headers, now=0.0)
    assert both.rpm is not None and both.rpd is not None
    assert both.rpm.level == 3 and both.rpd.level == 3
    with _pytest.raises(ValueError, match="header_bucket_scope"):
        _RL(rpm=1, header_bucket_scope="hour")  # type: ignore[arg-type]
