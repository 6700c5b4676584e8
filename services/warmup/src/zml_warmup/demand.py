"""Each model's and adapter's demand over the planning window, from the routers' completion
events (pure: time is passed in)."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    rate: float
    mean_prompt: float | None
    mean_output: float | None


class DemandWindow:
    """(ts, prompt tokens, output tokens) per requested name over ``window_s``."""

    def __init__(self, window_s: float, started_at: float) -> None:
        self.window_s = window_s
        self.started_at = started_at
        self._events: dict[str, deque[tuple[float, int, int]]] = defaultdict(deque)

    def record(self, name: str, ts: float, prompt: int, output: int) -> None:
        self._events[name].append((ts, prompt, output))

    def names(self) -> list[str]:
        return sorted(self._events)

    def shape(self, name: str, now: float) -> Shape:
        dq = self._events.get(name)
        if not dq:
            return Shape(0.0, None, None)
        while dq and dq[0][0] < now - self.window_s:
            dq.popleft()
        span = max(1.0, min(self.window_s, now - self.started_at))
        sized = [(p, o) for _, p, o in dq if p or o]
        if not sized:
            return Shape(len(dq) / span, None, None)
        return Shape(len(dq) / span, sum(p for p, _ in sized) / len(sized), sum(o for _, o in sized) / len(sized))
