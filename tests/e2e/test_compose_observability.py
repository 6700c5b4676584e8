"""compose.yaml validates with docker-compose (Debian's `docker-compose`, installed by .ci/run),
has the observability services, and the provisioned Grafana dashboard only queries metric names
the services really export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from conftest import Stack

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "observability" / "grafana" / "dashboards" / "zml.json"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "min", "avg", "le", "without"}


def test_docker_compose_validates_the_file_with_the_observability_services() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        print("SKIP reason: no docker-compose (apt-get install -y docker-compose; .ci/run does)")
        pytest.skip("no `docker-compose` binary (Debian package `docker-compose`; .ci/run installs it)")
    out = subprocess.run([binary, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"prometheus", "grafana", "otel-collector", "jaeger"} <= set(services)
    assert services["router"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    for name in ("prometheus", "grafana", "otel-collector", "jaeger"):
        image = services[name]["image"]
        assert image.split("/")[0] in ("prom", "grafana", "otel", "jaegertracing"), image  # official images
    for mount in [*services["prometheus"]["volumes"], *services["grafana"]["volumes"]]:
        source = mount["source"] if isinstance(mount, dict) else mount.split(":")[0]
        assert Path(source).exists(), source


def exported_names(stack: Stack) -> set[str]:
    """Every series name the services expose: the metrics their modules register (also those
    with no sample yet) plus what a running router reports at scrape time (node gauges)."""
    import zml_gateway.metrics  # noqa: F401  (registers the gateway's metrics)
    import zml_health.metrics  # noqa: F401
    import zml_router.telemetry.metrics  # noqa: F401
    import zml_warmup.metrics  # noqa: F401

    names: set[str] = set()
    for family in REGISTRY.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}.get(family.type, [""])
        names.update(family.name + s for s in suffixes)
    port = next(p for n, p in stack.metrics_ports.items() if n.startswith("router"))
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    names.update(m.group(1) for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    # Families declared at scrape time whose samples may not exist yet (an empty queue).
    names.update(m.group(1) for m in re.finditer(r"^# TYPE (\S+) gauge$", text, re.M))
    return names


def test_grafana_dashboard_queries_only_exported_metrics(zml_stack: Stack) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    exported = exported_names(zml_stack)
    used = set()
    for expr in exprs:
        without_strings = re.sub(r'"[^"]*"', "", expr)
        without_labels = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\bby \([^)]*\)", "", without_strings)
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_labels):
            if word not in PROMQL_WORDS:
                used.add(word)
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries metrics nothing exports: {missing}"
    # The GenAI names, and every family of the list, are on the dashboard.
    for name in ("gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_server_request_duration_seconds_bucket",
                 "gen_ai_client_token_usage_sum", "zml_node_state", "zml_node_health_score", "zml_node_in_flight",
                 "zml_node_queue_depth", "zml_node_cooldown_seconds", "zml_node_saturated_seconds",
                 "zml_node_price_per_hour", "zml_router_decisions_total", "zml_router_failovers_total",
                 "zml_router_queue_depth", "zml_router_queue_expired_total", "zml_gateway_rate_limited_total",
                 "zml_warmup_loads_total", "zml_warmup_load_seconds_bucket"):
        assert name in used, name
