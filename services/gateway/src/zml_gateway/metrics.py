"""The gateway's Prometheus metrics, served at GET /metrics on the gateway's own port."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter

from zmlcore.telemetry.metrics import DURATION_BUCKETS, Children
from zmlcore.telemetry.tally import CounterTally, HistogramTally, Tallies
from zml_gateway.access import Caller

# Bumped on every inference request: tallies (plain numbers, folded into the same Prometheus
# families at scrape time, zmlcore.telemetry.tally), not prometheus_client's locked Counter/Histogram.
REQUESTS = CounterTally(
    "zml_gateway_requests", "HTTP inference requests answered, by route and HTTP status.",
    ["route", "status"])
DURATION = HistogramTally(
    "zml_gateway_request_duration_seconds",
    "Time from the request's arrival to its last byte (streams: to [DONE]).", ["route"],
    buckets=DURATION_BUCKETS)
REGISTRY.register(Tallies(REQUESTS, DURATION))
RATE_LIMITED = Children(Counter(
    "zml_gateway_rate_limited", "Requests refused with 429 RATE_LIMITED, by key label.", ["key"]))

def key_label(caller: Caller) -> str:
    """A run-time key's label (``zml keys create --label``) or id, a static key's id
    (``static-<hash>``), or ``anonymous`` (no keys configured): never the key itself, and
    never a client address (unbounded)."""
    record = caller.record
    if record is not None:
        return record.label or f"key:{record.id}"
    return "anonymous" if caller.identity.startswith("addr:") else caller.identity


def rate_limited(caller: Caller) -> None:
    RATE_LIMITED(key_label(caller)).inc()
