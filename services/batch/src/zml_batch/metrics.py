"""The batch runner's Prometheus metrics (its /metrics port: [metrics] batch_port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from zmlcore.telemetry.metrics import DURATION_BUCKETS, Children

LINES = Children(Counter(
    "zml_batch_lines", "Batch lines by outcome: completed (answered 200), failed (an error answer or attempts "
    "used up), expired and cancelled (written as such when their batch ended), retried (sent again after a "
    "failed attempt), refused (no headroom: waited, not an attempt).", ["outcome"]))
TOKENS = Children(Counter(
    "zml_batch_tokens", "Tokens of answered batch lines, by accelerator family that served them and kind "
    "(prompt, completion).", ["family", "kind"]))
IN_FLIGHT = Gauge("zml_batch_lines_in_flight", "Batch lines this runner has sent and not yet answered.")
WINDOW = Children(Gauge("zml_batch_window", "Lines of a model this runner may have in flight now (the routers' "
                                            "headroom, learnt from their refusals).", ["model"]))
SHARDS = Gauge("zml_batch_shards_held", "Shards (units of work) this runner holds.")
LINE_TIME = Histogram("zml_batch_line_seconds", "From a line's first send to its recorded answer.",
                      buckets=DURATION_BUCKETS)
BATCHES = Children(Counter("zml_batch_batches", "Batches this runner finished, by final status.", ["status"]))
