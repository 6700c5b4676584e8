"""Per-model request rate and quiet-window detection (pure: time is passed in).

A model is *quiet* once its request rate has stayed below ``quiet_rps`` for ``quiet_min_s``
(measured from the routers' completion events and, as a fallback, the nodes' own request
counters), or at any time inside a fixed quiet window from zml.toml.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from datetime import datetime, timezone

from zmlcore.config import WarmupConfig, parse_window
from zmlcore.messages import NodeState


class RateTracker:
    """Completion events per model over a sliding window."""

    def __init__(self, window_s: float, started_at: float) -> None:
        self.window_s = window_s
        self.started_at = started_at
        self._events: dict[str, deque[float]] = defaultdict(deque)

    def record(self, model: str, ts: float) -> None:
        self._events[model].append(ts)

    def rate(self, model: str, now: float) -> float:
        dq = self._events.get(model)
        if not dq:
            return 0.0
        while dq and dq[0] < now - self.window_s:
            dq.popleft()
        # Early on the window is not full yet: divide by what was observed (at least 1 s).
        span = max(1.0, min(self.window_s, now - self.started_at))
        return len(dq) / span


def metrics_rate(model: str, states: Iterable[NodeState]) -> float:
    """Requests/s of ``model`` from the nodes' counters: a node's rate is shared equally among
    the models it has loaded (engines count per node; an overestimate only delays warm-ups)."""
    total = 0.0
    for st in states:
        if model in st.models and st.requests_per_s > 0:
            total += st.requests_per_s / max(1, len(st.models))
    return total


def in_fixed_window(windows: Iterable[str], now: float) -> bool:
    """Is ``now`` (unix seconds) inside one of the "HH:MM-HH:MM" UTC windows?"""
    t = datetime.fromtimestamp(now, tz=timezone.utc)
    minute = t.hour * 60 + t.minute
    for text in windows:
        start, end = parse_window(text)
        if (start <= minute < end) if start < end else (minute >= start or minute < end):
            return True
    return False


class QuietDetector:
    """Remembers since when each model has been quiet."""

    def __init__(self, cfg: WarmupConfig, started_at: float) -> None:
        self.cfg = cfg
        self.started_at = started_at
        self.quiet_since: dict[str, float | None] = {}

    def update(self, model: str, rate: float, now: float) -> bool:
        """Feed the current rate; True when the model is in a quiet window now."""
        if rate >= self.cfg.quiet_rps:
            self.quiet_since[model] = None
        elif self.quiet_since.get(model) is None:
            # Unknown before we started watching: quiet only after quiet_min_s of our own.
            self.quiet_since[model] = now if model in self.quiet_since else self.started_at
        since = self.quiet_since[model]
        measured = since is not None and now - since >= self.cfg.quiet_min_s
        return measured or in_fixed_window(self.cfg.quiet_windows, now)

    def reason(self, now: float) -> str:
        return "fixed_window" if in_fixed_window(self.cfg.quiet_windows, now) else "quiet_window"
