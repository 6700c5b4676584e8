from zml_gateway.ratelimit import TokenBucket


def test_burst_then_steady_rate() -> None:
    b = TokenBucket(rate_per_s=2.0, burst=3, now=0.0)
    assert [b.take(0.0)[:2] for _ in range(3)] == [(True, 2), (True, 1), (True, 0)]
    ok, left, wait = b.take(0.0)
    assert not ok and left == 0 and abs(wait - 0.5) < 1e-9  # one token comes back in 1/rate
    assert b.take(0.5)[0] and not b.take(0.5)[0]


def test_refill_caps_at_burst_and_reset_is_time_to_full() -> None:
    b = TokenBucket(rate_per_s=1.0, burst=2, now=0.0)
    b.take(0.0)
    ok, left, reset = b.take(100.0)
    assert ok and left == 1 and abs(reset - 1.0) < 1e-9
