"""zmlcore.telemetry.metrics.Children: cached label children, bounded label combinations."""

from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry, Counter, generate_latest

from zmlcore.telemetry import metrics
from zmlcore.telemetry.setup import DECISION_ID, REQUEST_ID, JsonFormatter


def test_children_are_cached_and_capped(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "MAX_CHILDREN", 3)
    reg = CollectorRegistry()
    c = metrics.Children(Counter("t_requests", "test", ["model"], registry=reg))
    assert c("a") is c("a")
    for i in range(10):  # a caller sending random model names
        c(f"m{i}").inc()
    text = generate_latest(reg).decode()
    assert 't_requests_total{model="other"} 8.0' in text
    assert text.count("t_requests_total{") == 3 + 1  # the first three, then "other"


def test_json_log_lines_carry_the_request_ids() -> None:
    fmt = JsonFormatter("zml-router")
    t1, t2 = REQUEST_ID.set("r-1"), DECISION_ID.set("d-1")
    try:
        record = logging.LogRecord("zml.router", logging.INFO, __file__, 1, "attempt %d failed", (1,), None)
        line = json.loads(fmt.format(record))
    finally:
        REQUEST_ID.reset(t1)
        DECISION_ID.reset(t2)
    assert line["msg"] == "attempt 1 failed" and line["level"] == "info" and line["service"] == "zml-router"
    assert line["request_id"] == "r-1" and line["decision_id"] == "d-1" and "trace_id" not in line
