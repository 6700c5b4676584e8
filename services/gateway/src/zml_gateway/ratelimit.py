"""Token buckets for the gateway's per-key limits (pure: time is passed in).

    bucket = TokenBucket(rate_per_s=10, burst=20)
    ok, remaining, reset_s = bucket.take(now=time.monotonic())
"""

from __future__ import annotations


class TokenBucket:
    __slots__ = ("rate", "burst", "level", "stamp")

    def __init__(self, rate_per_s: float, burst: float, now: float = 0.0) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.level = burst
        self.stamp = now

    def take(self, now: float, n: float = 1.0) -> tuple[bool, int, float]:
        """Take ``n`` tokens if there are. Returns (taken, whole tokens left, seconds until the
        bucket is full again — or, when refused, until ``n`` tokens are there)."""
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level >= n:
            self.level -= n
            return True, int(self.level), (self.burst - self.level) / self.rate
        return False, 0, (n - self.level) / self.rate
