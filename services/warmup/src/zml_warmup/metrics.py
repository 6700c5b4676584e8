"""The warmup service's Prometheus metrics (its /metrics port: [metrics] warmup_port)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from zmlcore.messages.warmup import WarmupEvent
from zmlcore.telemetry.metrics import WAIT_BUCKETS, Children

EVENTS = Children(Counter(
    "zml_warmup_loads", "Model loads by phase (started, loaded, failed, probed), model, node and reason "
    "(quiet_window, fixed_window, serve, keep_warm).", ["model", "node", "phase", "reason"]))
LOAD_TIME = Children(Histogram(
    "zml_warmup_load_seconds", "Time from asking a node to load a model until the model was routable there.",
    ["model", "node"], buckets=WAIT_BUCKETS))


def event(ev: WarmupEvent) -> None:
    EVENTS(ev.model, ev.node_id, ev.phase, ev.reason).inc()
    if ev.phase == "loaded" and ev.elapsed_s is not None:
        LOAD_TIME(ev.model, ev.node_id).observe(ev.elapsed_s)
