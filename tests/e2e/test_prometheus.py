"""A real Prometheus server (Debian's `prometheus` package, installed by .ci/run) scrapes the
stack; its HTTP query API returns ZML's series after traffic."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import FLEET, MODEL, Stack
from zmlcore.runtime.launch import free_port, spawn, wait_port


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        print("SKIP reason: no `prometheus` binary (apt-get install -y prometheus; .ci/run does)")
        pytest.skip("no `prometheus` binary on PATH (Debian package `prometheus`; .ci/run installs it)")
    return found


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(base + "/api/v1/query", params={"query": promql}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _total(base: str, promql: str) -> float:
    """A one-series sum's value now (0 while it has no series)."""
    r = _query(base, promql)
    return float(r[0]["value"][1]) if r else 0.0


def _ready(base: str, timeout: float = 60.0) -> bool:
    """Prometheus answers 503 while its storage starts, after its port is open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/-/ready", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def _eventually(base: str, promql: str, ok: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    result: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        result = _query(base, promql)
        if ok(result):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{promql}: {result}")


def _settled(base: str, promql: str, ok: Any, timeout: float) -> list[dict[str, Any]] | None:
    """As _eventually, but None when ``ok`` never held."""
    try:
        return _eventually(base, promql, ok, timeout)
    except AssertionError:
        return None


CHAT = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
QUANTILE = "histogram_quantile(0.9, sum by (le) (rate(gen_ai_server_request_duration_seconds_bucket[1m])))"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_prometheus_scrapes_every_service_and_answers_queries(zml_stack: Stack, tmp_path: Path) -> None:
    binary = _prometheus()
    gw = zml_stack.gateway_url.removeprefix("http://")
    routers = [f"127.0.0.1:{p}" for n, p in zml_stack.metrics_ports.items() if n.startswith("router")]
    health = f"127.0.0.1:{zml_stack.metrics_ports['health']}"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: zml-gateway\n    static_configs: [{{targets: ['{gw}']}}]\n"
        f"  - job_name: zml-router\n    static_configs: [{{targets: {routers!r}}}]\n"
        f"  - job_name: zml-health\n    static_configs: [{{targets: ['{health}']}}]\n"
    )
    port = free_port()
    proc = spawn("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"])
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_port("127.0.0.1", port, 30) and _ready(base), proc.tail()
        # Every target up.
        _eventually(base, "up", lambda r: len(r) == 2 + len(routers) and all(s["value"][1] == "1" for s in r))
        # The session's stack served earlier tests: the counts below start from there, so each
        # wait is for this test's five requests on top (the stack serves nothing else meanwhile).
        counts = {
            f'sum(zml_router_requests_total{{model="{MODEL}",code="OK"}})': 0.0,
            f'sum(gen_ai_server_time_to_first_token_seconds_count{{gen_ai_request_model="{MODEL}"}})': 0.0,
            f'sum(gen_ai_server_request_duration_seconds_count{{gen_ai_request_model="{MODEL}"}})': 0.0,
            'sum(zml_gateway_requests_total{route="chat",status="200"})': 0.0,
        }
        for promql in counts:
            counts[promql] = _total(base, promql)
        with httpx.Client(base_url=zml_stack.gateway_url, timeout=30) as http:
            for _ in range(5):
                r = http.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
            for promql, before in counts.items():
                _eventually(base, promql, lambda r, before=before: r and float(r[0]["value"][1]) >= before + 5)
            # A percentile query an operator would run works on the histograms. rate() needs a
            # bucket to grow between two samples of one series in its window, and Prometheus does
            # not count a new series' first value as growth. A request grows a scraped series only
            # if it reaches the same router and node (both are labels); otherwise it starts one.
            # Seen in CI, NaN for a whole minute: earlier tests' counts met the waits at once, so
            # 5 + 5 requests went out within ~0.2 s, to a node the earlier traffic had not used
            # (reproduced with that traffic's node overloaded): new series, all ten counted in
            # their first scrape, nothing after. So: the five above are scraped now (the duration
            # count), then one request at a time until the quantile is a number; each lands after
            # a scrape that saw the ones before it.
            deadline = time.monotonic() + 60
            while True:
                r = http.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
                q = _settled(base, QUANTILE, lambda r: r and r[0]["value"][1] != "NaN", timeout=3.0)
                if q is not None:
                    break
                assert time.monotonic() < deadline, f"{QUANTILE}: still NaN"
        assert float(q[0]["value"][1]) > 0
        # The per-node gauges: every node of the fleet, by family.
        nodes = _eventually(base, 'max by (node, family) (zml_node_state{status="up"})',
                            lambda r: len(r) == len(FLEET))
        assert {s["metric"]["node"] for s in nodes} == {n for n, _, _ in FLEET}
        _eventually(base, 'sum(zml_health_probes_total{result="ok"})', lambda r: r and float(r[0]["value"][1]) > 0)
    finally:
        proc.stop()
