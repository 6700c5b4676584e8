"""OTLP metrics push (OTEL_METRICS_EXPORTER=otlp): a real OTLP/HTTP receiver in the test (the
protobuf parsed with opentelemetry-proto, receiver shared with test_tracing) gets, from the
gateway and the router, the same counters and histograms their /metrics pages show - every
OTEL_METRIC_EXPORT_INTERVAL, and once more on SIGTERM (the final flush)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from test_metrics import scrape, total
from test_tracing import Receiver

from conftest import MODEL, Stack, launch_stack
from zmlcore.telemetry.metrics import DURATION_BUCKETS

Attrs = tuple[tuple[str, str], ...]


def latest(reqs: list[ExportMetricsServiceRequest], service: str, metric: str) -> dict[Attrs, Any]:
    """The last data point per attribute set of ``metric`` pushed by ``service``."""
    out: dict[Attrs, Any] = {}
    for req in reqs:
        for rm in req.resource_metrics:
            name = next((a.value.string_value for a in rm.resource.attributes if a.key == "service.name"), "")
            if name != service:
                continue
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name != metric:
                        continue
                    kind = m.WhichOneof("data")
                    for p in getattr(m, kind).data_points:
                        attrs = tuple(sorted((a.key, a.value.string_value) for a in p.attributes))
                        out[attrs] = (kind, m, p)
    return out


def counter(reqs: list[ExportMetricsServiceRequest], service: str, metric: str, **labels: str) -> float:
    total_ = 0.0
    for attrs, (kind, m, p) in latest(reqs, service, metric).items():
        assert kind == "sum" and m.sum.is_monotonic and m.sum.aggregation_temporality == 2  # CUMULATIVE
        if all(dict(attrs).get(k) == v for k, v in labels.items()):
            total_ += p.as_double
    return total_


def wait_for(receiver: Receiver, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with receiver.lock:
            reqs = list(receiver.metrics)
        try:
            return check(reqs)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def traffic(stack: Stack, n: int) -> None:
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as http:
        for _ in range(n):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 5,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text


def pushing(own_nats: str, tmp: Path, interval_ms: int) -> tuple[Stack, Receiver]:
    receiver = Receiver()
    env = {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "none",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"http://127.0.0.1:{receiver.port}/v1/metrics",
           "OTEL_METRIC_EXPORT_INTERVAL": str(interval_ms)}
    try:
        return launch_stack(own_nats, tmp, routers=1, env=env), receiver
    except BaseException:
        receiver.close()
        raise


@pytest.fixture()
def pushed(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    # Per test: two stacks on one broker would share the routers' queue group.
    stack, receiver = pushing(own_nats, tmp_path_factory.mktemp("otlp"), 500)
    try:
        yield stack, receiver
    finally:
        stack.stop()
        receiver.close()


def test_gateway_and_router_push_what_metrics_shows(pushed: tuple[Stack, Receiver]) -> None:
    stack, receiver = pushed
    traffic(stack, 4)
    gw_page = scrape(stack.gateway_url + "/metrics")
    rt_page = scrape(f"http://127.0.0.1:{stack.metrics_ports['router-1']}/metrics")
    gw_ok = total(gw_page, "zml_gateway_requests_total", route="chat", status="200")
    rt_ok = total(rt_page, "zml_router_requests_total", model=MODEL, code="OK")
    assert gw_ok >= 4 and rt_ok >= 4

    # No traffic since the scrape: the next pushes carry exactly the values /metrics showed.
    def same(reqs: list[ExportMetricsServiceRequest]) -> None:
        assert counter(reqs, "zml-gateway", "zml_gateway_requests", route="chat", status="200") == gw_ok
        assert counter(reqs, "zml-router", "zml_router_requests", model=MODEL, code="OK") == rt_ok
        durations = latest(reqs, "zml-router", "gen_ai_server_request_duration_seconds")
        ours = [(m, p) for attrs, (kind, m, p) in durations.items()
                if kind == "histogram" and dict(attrs).get("gen_ai_request_model") == MODEL]
        assert ours
        page_count = total(rt_page, "gen_ai_server_request_duration_seconds_count", gen_ai_request_model=MODEL)
        assert sum(p.count for _, p in ours) == page_count > 0
        for m, p in ours:
            assert m.histogram.aggregation_temporality == 2
            assert tuple(p.explicit_bounds) == DURATION_BUCKETS
            assert len(p.bucket_counts) == len(DURATION_BUCKETS) + 1 and sum(p.bucket_counts) == p.count
        # the router's labels, as on /metrics
        assert {"model", "policy", "family", "node", "code"} <= {
            k for attrs in latest(reqs, "zml-router", "zml_router_requests") for k, _ in attrs}

    wait_for(receiver, same)

    # Pushed every interval, not once: more requests keep arriving.
    with receiver.lock:
        before = len(receiver.metrics)

    def more(reqs: list[ExportMetricsServiceRequest]) -> None:
        assert len(reqs) >= before + 4

    wait_for(receiver, more, timeout=30)


def test_sigterm_flushes_the_last_values(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    # An hour's interval: nothing is pushed until the services stop, then once each.
    stack, receiver = pushing(own_nats, tmp_path_factory.mktemp("otlp-flush"), 3_600_000)
    try:
        traffic(stack, 3)
        rt_ok = total(scrape(f"http://127.0.0.1:{stack.metrics_ports['router-1']}/metrics"),
                      "zml_router_requests_total", model=MODEL, code="OK")
        with receiver.lock:
            assert receiver.metrics == []
        stack.stop()
        with receiver.lock:
            reqs = list(receiver.metrics)
        assert counter(reqs, "zml-router", "zml_router_requests", model=MODEL, code="OK") == rt_ok >= 3
        assert counter(reqs, "zml-gateway", "zml_gateway_requests", route="chat") >= 3
    finally:
        stack.stop()
        receiver.close()
