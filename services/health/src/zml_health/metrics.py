"""The health service's Prometheus metrics (its /metrics port: [metrics] health_port)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from zmlcore.messages import NodeState
from zmlcore.telemetry.metrics import Children

PROBES = Children(Counter(
    "zml_health_probes", "Node polls, by node and result (ok, loading, slow, failed).", ["node", "result"]))
PROBE_TIME = Children(Histogram(
    "zml_health_probe_seconds", "Time one poll of a node took (engine probe plus node probe).", ["node"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)))
TRANSITIONS = Children(Counter(
    "zml_health_status_changes", "Node status changes, by node and new status.", ["node", "status"]))

_last: dict[str, str] = {}


def polled(node_id: str, ok: bool, loading: bool, slow: bool, seconds: float, state: NodeState) -> None:
    result = "ok" if ok else "loading" if loading else "slow" if slow else "failed"
    PROBES(node_id, result).inc()
    PROBE_TIME(node_id).observe(seconds)
    if _last.get(node_id) != state.status:
        _last[node_id] = state.status
        TRANSITIONS(node_id, state.status).inc()
