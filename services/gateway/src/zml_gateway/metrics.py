"""The gateway's Prometheus metrics, served at GET /metrics on the gateway's own port."""

from __future__ import annotations

import hashlib

from prometheus_client import Counter, Histogram

from zmlcore.metrics import DURATION_BUCKETS, Children

REQUESTS = Children(Counter(
    "zml_gateway_requests", "HTTP inference requests answered, by route and HTTP status.",
    ["route", "status"]))
DURATION = Children(Histogram(
    "zml_gateway_request_duration_seconds",
    "Time from the request's arrival to its last byte (streams: to [DONE]).", ["route"],
    buckets=DURATION_BUCKETS))
RATE_LIMITED = Children(Counter(
    "zml_gateway_rate_limited", "Requests refused with 429 RATE_LIMITED, by key label.", ["key"]))

_labels: dict[bytes, str] = {}


def key_label(who: bytes, keyed: bool) -> str:
    """A stable, non-secret label for a caller: ``key-<8 hex of sha256>`` for a bearer key,
    ``addr-...`` for a client address (no keys configured). Never the key itself."""
    label = _labels.get(who)
    if label is None:
        if len(_labels) > 10_000:
            _labels.clear()
        label = _labels[who] = ("key-" if keyed else "addr-") + hashlib.sha256(who).hexdigest()[:8]
    return label


def rate_limited(who: bytes, keyed: bool) -> None:
    RATE_LIMITED(key_label(who, keyed)).inc()
