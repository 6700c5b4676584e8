"""Per-node health state machine and score (pure: time passed in).

* A node that has never answered is ``loading`` during the start-up grace window.
* ``down`` after ``down_after`` consecutive failed probes; back ``up`` after ``up_after``
  consecutive good ones (flapping suppression); one failure does not take a node down.
* health score 0-100 = 100 x (1 - error_rate) x 1/(1 + queue/capacity): an idle node with no
  errors scores 100, a node with a full extra batch waiting scores ~50. See docs/health.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zmlcore.config import HealthConfig
from zmlcore.messages import NodeStatus

from zml_health.adapters.base import Probe


def health_score(error_rate: float, queue_depth: int, capacity: int) -> float:
    cap = max(capacity, 1)
    return round(100.0 * (1.0 - min(max(error_rate, 0.0), 1.0)) / (1.0 + max(queue_depth, 0) / cap), 1)


@dataclass(slots=True)
class Tracker:
    started_at: float
    status: NodeStatus = "unknown"
    ever_ok: bool = False
    fails: int = 0
    oks: int = 0
    last_ok: float = 0.0
    reason: str = ""
    results: deque[bool] = field(default_factory=lambda: deque(maxlen=20))
    last_tokens: tuple[float, float] | None = None  # (time, generation_tokens_total)
    tokens_per_s: float = 0.0

    @property
    def error_rate(self) -> float:
        return 0.0 if not self.results else self.results.count(False) / len(self.results)

    def observe(self, probe: Probe, now: float, cfg: HealthConfig) -> NodeStatus:
        self.results.append(probe.ok)
        if probe.ok:
            self.oks += 1
            self.fails = 0
            self.last_ok = now
            self.reason = ""
            if not self.ever_ok or self.status in ("unknown", "loading") or self.oks >= cfg.up_after:
                self.status = "up"
            self.ever_ok = True
            if probe.generation_tokens_total is not None:
                if self.last_tokens is not None and now > self.last_tokens[0]:
                    dt = now - self.last_tokens[0]
                    self.tokens_per_s = max(0.0, (probe.generation_tokens_total - self.last_tokens[1]) / dt)
                self.last_tokens = (now, probe.generation_tokens_total)
            return self.status
        self.fails += 1
        self.oks = 0
        self.reason = probe.error
        if probe.loading or (not self.ever_ok and now - self.started_at < cfg.startup_grace_s):
            self.status = "loading"
        elif self.fails >= cfg.down_after or not self.ever_ok:
            self.status = "down"
        return self.status
