"""Client-side rate limiting: token buckets for rpm, tpm, rpd and tpd, all enforced at once.

Pure maths, no clock: callers pass ``now`` (seconds, monotonic) and sleep for the delay
returned. Reservations are taken immediately and may drive a bucket negative; the delay is
how long until the debt is paid off, so concurrent callers queue up in order (virtual
scheduling) without a lock held while sleeping.

Example::

    lim = RateLimiter(rpm=60)
    delay = lim.reserve(tokens=100, now=time.monotonic())   # sleep(delay), then send
    lim.settle(reserved=100, actual=80, now=time.monotonic())
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["HeaderScope", "RateLimiter", "TokenBucket", "parse_reset"]

MINUTE = 60.0
DAY = 86_400.0


@dataclass(slots=True)
class TokenBucket:
    """``capacity`` units at most, refilled at ``rate`` units per second."""

    capacity: float
    rate: float
    level: float
    updated: float = 0.0

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_after(self, amount: float) -> float:
        """Seconds until the level would be back at zero after taking ``amount``."""
        after = self.level - amount
        return 0.0 if after >= 0 else -after / self.rate


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_reset(value: str) -> float | None:
    """``x-ratelimit-reset-*`` values: ``"1s"``, ``"6m0s"``, ``"20ms"`` or plain seconds."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    total, matched = 0.0, False
    for num, unit in _DURATION.findall(value):
        matched = True
        total += float(num) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]
    return total if matched else None


HeaderScope = Literal["minute", "day", "both"]


class RateLimiter:
    """Requests and tokens per minute and per day, with bursts.

    ``max_request_burst`` / ``max_token_burst`` size the per-minute buckets (default: one
    second's worth, at least one request, so the rate holds over any window); day buckets
    hold the whole day's allowance.
    """

    def __init__(
        self,
        *,
        rpm: float | None = None,
        tpm: float | None = None,
        rpd: float | None = None,
        tpd: float | None = None,
        max_request_burst: float | None = None,
        max_token_burst: float | None = None,
        header_bucket_scope: HeaderScope = "minute",
        now: float = 0.0,
    ) -> None:
        if header_bucket_scope not in ("minute", "day", "both"):
            raise ValueError(f"header_bucket_scope must be 'minute', 'day' or 'both', got {header_bucket_scope!r}")
        #: Which buckets the server's x-ratelimit-* headers correct: the per-minute ones (OpenAI's
        #: headers describe minute windows), the per-day ones (providers whose headers count a
        #: day), or both.
        self.header_bucket_scope = header_bucket_scope
        for name, v in (("rpm", rpm), ("tpm", tpm), ("rpd", rpd), ("tpd", tpd),
                        ("max_request_burst", max_request_burst), ("max_token_burst", max_token_burst)):
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        self.requests: list[TokenBucket] = []
        self.tokens: list[TokenBucket] = []
        self.rpm = self._add(self.requests, rpm, MINUTE, max_request_burst, now)
        self.rpd = self._add(self.requests, rpd, DAY, None, now)
        self.tpm = self._add(self.tokens, tpm, MINUTE, max_token_burst, now)
        self.tpd = self._add(self.tokens, tpd, DAY, None, now)

    @staticmethod
    def _add(into: list[TokenBucket], limit: float | None, period: float, burst: float | None,
             now: float) -> TokenBucket | None:
        if limit is None:
            return None
        if period == MINUTE:
            capacity = burst if burst is not None else max(1.0, limit / MINUTE)
        else:
            capacity = float(limit)
        b = TokenBucket(capacity=float(capacity), rate=limit / period, level=float(capacity), updated=now)
        into.append(b)
        return b

    @property
    def enabled(self) -> bool:
        return bool(self.requests or self.tokens)

    def reserve(self, tokens: int, now: float) -> float:
        """Take one request and ``tokens`` tokens from every bucket; return the seconds to wait."""
        delay = 0.0
        for b in self.requests:
            b.refill(now)
            delay = max(delay, b.wait_after(1))
            b.level -= 1
        for b in self.tokens:
            b.refill(now)
            delay = max(delay, b.wait_after(tokens))
            b.level -= tokens
        return delay

    def settle(self, reserved: int, actual: int | None, now: float) -> None:
        """Correct the token buckets once the real usage is known (refund or charge)."""
        if actual is None or actual < 0:
            return
        for b in self.tokens:
            b.refill(now)
            b.level = min(b.capacity, b.level + reserved - actual)

    def sync(self, headers: Mapping[str, str], now: float) -> None:
        """Lower the buckets of ``header_bucket_scope`` to the server's view
        (``x-ratelimit-remaining-*``); when a remaining count is 0, wait for its
        ``x-ratelimit-reset-*``."""
        pairs: list[tuple[str, TokenBucket | None]] = []
        if self.header_bucket_scope in ("minute", "both"):
            pairs += [("requests", self.rpm), ("tokens", self.tpm)]
        if self.header_bucket_scope in ("day", "both"):
            pairs += [("requests", self.rpd), ("tokens", self.tpd)]
        for kind, bucket in pairs:
            if bucket is None:
                continue
            remaining = headers.get(f"x-ratelimit-remaining-{kind}")
            if remaining is None:
                continue
            try:
                left = float(remaining)
            except ValueError:
                continue
            bucket.refill(now)
            if left <= 0:
                reset = parse_reset(headers.get(f"x-ratelimit-reset-{kind}", "") or "")
                bucket.level = min(bucket.level, -(reset or 0.0) * bucket.rate)
            else:
                bucket.level = min(bucket.level, left)
