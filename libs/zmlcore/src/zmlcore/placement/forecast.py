"""The demand a plan provides for: each model's and adapter's measured request rate, looked
ahead (pure: time is passed in).

A plan made on the rate measured now serves it only once its new replicas have loaded (20-130 s,
more where a node drains another model first), and the rate it measures is already a window's
mean, behind a rising model. So the planner provides for the rate it expects ``horizon_s``
ahead: the rate now, plus its trend over the last ``trend_s`` (a least-squares slope over the
rates measured at each plan) where it rises, plus ``spread`` times how far the measured rates
stray from that line (a model whose rate jumps gets the room before its queue builds). It never
provides for less than the rate now: a falling model keeps its capacity until its rate has
fallen (the plan's hysteresis then decides whether releasing it is worth its moves).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Lookahead:
    """[planner] forecast_horizon_s, trend_s, forecast_spread."""

    horizon_s: float = 0.0
    trend_s: float = 3600.0
    spread: float = 0.0

    @property
    def off(self) -> bool:
        return self.horizon_s <= 0 and self.spread <= 0


def ahead(samples: Sequence[tuple[float, float]], la: Lookahead) -> float:
    """The rate to provide for from ``samples`` ((time, rate measured then), oldest first, the
    last one now's).

    >>> rising = [(0.0, 1.0), (600.0, 1.2), (1200.0, 1.4)]
    >>> round(ahead(rising, Lookahead(horizon_s=600)), 3)  # 1.4 now, +0.2 per 600 s
    1.6
    >>> ahead([(0.0, 1.4), (600.0, 1.2), (1200.0, 1.0)], Lookahead(horizon_s=600))  # falling: the rate now
    1.0
    >>> round(ahead([(0.0, 1.0), (600.0, 1.5), (1200.0, 1.0)], Lookahead(spread=1.0)), 3)  # strays 0.24
    1.236
    >>> ahead([(0.0, 2.0)], Lookahead(horizon_s=600, spread=2.0))
    2.0
    """
    if not samples:
        return 0.0
    now = samples[-1][1]
    if la.off or len(samples) < 2:
        return now
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    stt = sum((t - mt) ** 2 for t, _ in samples)
    if stt <= 0:
        return now
    slope = sum((t - mt) * (r - mr) for t, r in samples) / stt
    sd = math.sqrt(sum((r - mr - slope * (t - mt)) ** 2 for t, r in samples) / n)
    return now + max(0.0, slope * la.horizon_s) + la.spread * sd


@dataclass(slots=True)
class RateHistory:
    """The rates measured at each plan, per requested name, over ``trend_s``."""

    trend_s: float = 3600.0
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def observe(self, name: str, t: float, rate: float, min_gap_s: float = 1.0) -> list[tuple[float, float]]:
        """Add what the demand window measures of ``name`` at ``t`` (a plan asked again within
        ``min_gap_s``, ``zml plan --fresh``, replaces the last sample) and return its samples."""
        got = self.samples.setdefault(name, [])
        if got and t - got[-1][0] < min_gap_s:
            got[-1] = (t, rate)
        else:
            got.append((t, rate))
        cut = 0
        while cut < len(got) and got[cut][0] < t - self.trend_s:
            cut += 1
        if cut:
            del got[:cut]
        return got
