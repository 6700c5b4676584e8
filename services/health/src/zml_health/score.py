"""The node health score (0-100), a pure function. docs/health.md explains the formula.

    score = 100 x (1 - e) x 1 / (1 + 0.5 x running/capacity + waiting/capacity)

``e`` is the recent error rate (0-1). An idle node without errors scores 100; a node running a
full batch with nothing waiting scores 66.7; a full batch plus one more batch waiting scores
40; a node failing half its requests scores at most 50. Only "up" nodes have a score (others 0).
"""

from __future__ import annotations


def health_score(error_rate: float, running: int, waiting: int, capacity: int) -> float:
    """Score 0-100 from the recent error rate and the queue (running and waiting requests).

    >>> health_score(0.0, 0, 0, 32)
    100.0
    >>> health_score(0.0, 32, 32, 32)
    40.0
    """
    cap = max(int(capacity), 1)
    e = min(max(float(error_rate), 0.0), 1.0)
    load = 1.0 + 0.5 * max(running, 0) / cap + max(waiting, 0) / cap
    return round(100.0 * (1.0 - e) / load, 1)
