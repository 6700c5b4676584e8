"""Prometheus /metrics on every service, read after real traffic through the stack."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import FLEET, MODEL, Stack

Samples = list[tuple[str, dict[str, str], float]]


def scrape(url: str) -> Samples:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(r.text) for s in fam.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items()))


def scrape_routers(stack: Stack) -> Samples:
    out: Samples = []
    for name, port in stack.metrics_ports.items():
        if name.startswith("router"):
            out += scrape(f"http://127.0.0.1:{port}/metrics")
    return out


def test_every_service_counts_the_traffic_it_saw(zml_stack: Stack) -> None:
    gw_before = scrape(zml_stack.gateway_url + "/metrics")
    rt_before = scrape_routers(zml_stack)
    with httpx.Client(base_url=zml_stack.gateway_url, timeout=30) as http:
        for _ in range(3):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 5,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "max_tokens": 5, "stream": True,
                               "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": "hi"}]}) as s:
            assert s.status_code == 200
            s.read()
        bad = http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
        assert bad.status_code >= 400
    gw = scrape(zml_stack.gateway_url + "/metrics")
    rt = scrape_routers(zml_stack)

    def grew(after: Samples, before: Samples, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew(gw, gw_before, "zml_gateway_requests_total", route="chat", status="200") >= 4
    assert grew(gw, gw_before, "zml_gateway_request_duration_seconds_count", route="chat") >= 5
    bad_status = str(bad.status_code)
    assert grew(gw, gw_before, "zml_gateway_requests_total", route="chat", status=bad_status) >= 1
    assert grew(rt, rt_before, "zml_router_requests_total", model=MODEL, code="OK") >= 4
    assert grew(rt, rt_before, "zml_router_requests_total", model="no-such-model") >= 1
    assert grew(rt, rt_before, "gen_ai_server_time_to_first_token_seconds_count", gen_ai_request_model=MODEL,
                gen_ai_operation_name="chat") >= 4
    assert grew(rt, rt_before, "gen_ai_server_request_duration_seconds_count", gen_ai_request_model=MODEL) >= 4
    # 3 x 5 output tokens unstreamed + 5 streamed with include_usage
    assert grew(rt, rt_before, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") >= 20
    assert grew(rt, rt_before, "gen_ai_client_token_usage_count", gen_ai_token_type="input") >= 4
    assert grew(rt, rt_before, "zml_router_decisions_total") >= 4
    assert grew(rt, rt_before, "zml_router_decision_seconds_count") >= 4
    # Every node of the fleet, with its state and gauges, on every router.
    for node_id, _, _ in FLEET:
        assert total(rt, "zml_node_state", node=node_id, status="up") >= 1, node_id
        assert total(rt, "zml_node_health_score", node=node_id) > 0, node_id
        assert total(rt, "zml_node_price_per_hour", node=node_id) > 0, node_id
    assert any(n == "zml_node_in_flight" for n, _, _ in rt)
    assert any(n == "process_cpu_seconds_total" for n, _, _ in rt)  # the client's process metrics
    health = scrape(f"http://127.0.0.1:{zml_stack.metrics_ports['health']}/metrics")
    assert total(health, "zml_health_probes_total", result="ok") > 0


def test_the_gateway_metrics_route_is_read_only(zml_stack: Stack) -> None:
    r = httpx.post(zml_stack.gateway_url + "/metrics", timeout=10)
    assert r.status_code == 405
