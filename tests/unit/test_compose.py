"""Docker is not available here: check compose.yaml against what the services accept."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from zmlcore.config import load_config
from zmlcore.runtime.launch import endpoint_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PARSERS = {
    "sim": "zml_sim.cli",
    "gateway": "zml_gateway.__main__",
    "router": "zml_router.__main__",
    "health": "zml_health.__main__",
    "warmup": "zml_warmup.__main__",
    "batch-runner": "zml_batch.__main__",
}
KNOWN_ENV = {"ZML_LOG_LEVEL", "ZML_LOG_FORMAT", "ZML_NATS_URL", "ZML_NATS_REPLICAS", "ZML_GATEWAY_HOST", "ZML_GATEWAY_PORT",
             "ZML_API_KEYS", "ZML_NATS_NKEY", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_SAMPLER",
             "OTEL_METRICS_EXPORTER"}
#: Observability services from their official images (tests/e2e/test_compose_observability.py).
OBSERVABILITY = {"prometheus", "grafana", "otel-collector", "jaeger"}
#: ...of which these images are distroless: no binary a healthcheck could run.
NO_PROBE = {"otel-collector", "jaeger"}


CLUSTER_URLS = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"


def _in_repo(path: str) -> Path:
    assert path.startswith("/app/"), path  # the Dockerfile copies the repo to /app
    return ROOT / path[len("/app/"):]


@pytest.mark.parametrize("name", [n for n in SERVICES
                                  if not n.startswith("nats") and n != "creds" and n not in OBSERVABILITY])
def test_each_command_parses_with_the_service_cli(name: str) -> None:
    command = SERVICES[name]["command"]
    sub, args = command[0], command[1:]
    assert sub == name
    parser = importlib.import_module(PARSERS[sub]).build_parser()
    ns = parser.parse_args(args)
    assert _in_repo(ns.config).is_file()
    load_config(_in_repo(ns.config), env={})
    if name != "sim":
        assert ns.nats_url == CLUSTER_URLS


def test_env_vars_are_ones_the_services_read() -> None:
    for name, svc in SERVICES.items():
        if name in OBSERVABILITY:
            continue
        for var in (svc.get("environment") or {}):
            assert var in KNOWN_ENV, (name, var)


def test_ports_match() -> None:
    gw = SERVICES["gateway"]["command"]
    port = gw[gw.index("--port") + 1]
    assert SERVICES["gateway"]["ports"] == [f"{port}:{port}"]
    assert "-js" in SERVICES["nats"]["command"] and "ports" not in SERVICES["nats"]  # 4222 not on the host
    cfg_path = _in_repo(SERVICES["sim"]["command"][2])
    cfg = load_config(cfg_path, env={})
    exposed = set(SERVICES["sim"]["expose"])
    for node in cfg.nodes:
        host, node_port = endpoint_port(node.endpoint)
        assert host == "sim" and str(node_port) in exposed, node.id
    assert cfg.nats.url == CLUSTER_URLS and cfg.nats.replicas == 3


def test_dockerfile_installs_the_repo_and_runs_zml() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install" in text and 'ENTRYPOINT ["zml"]' in text
    for folder in ("libs", "services", "sdk"):
        assert f"COPY {folder}" in text


def test_every_long_running_service_is_in_compose() -> None:
    assert {"nats", "sim", "health", "warmup", "router", "gateway"} <= set(SERVICES)


def test_every_service_restarts_and_has_a_healthcheck() -> None:
    for name, svc in SERVICES.items():
        if name == "creds":  # one-shot: writes the identities, then NATS starts
            continue
        assert svc.get("restart") in ("unless-stopped", "always"), name
        if name in NO_PROBE:
            continue
        check = svc.get("healthcheck")
        assert check and check["test"][0] == "CMD", name
        if name in PARSERS and name != "sim":
            # the file the healthcheck reads is the one the service touches
            ns = importlib.import_module(PARSERS[name]).build_parser().parse_args(svc["command"][1:])
            assert ns.alive_file and ns.alive_file in check["test"], name
            assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
    sim_check = " ".join(SERVICES["sim"]["healthcheck"]["test"])
    assert "/health" in sim_check and any(f"127.0.0.1:{p}" in sim_check for p in SERVICES["sim"]["expose"])


def test_a_three_server_nats_cluster() -> None:
    servers = {name: svc for name, svc in SERVICES.items() if name.startswith("nats")}
    assert len(servers) == 3
    names, volumes = set(), set()
    for name, svc in servers.items():
        cmd = svc["command"]
        names.add(cmd[cmd.index("--server_name") + 1])
        volumes.add(svc["volumes"][0].split(":")[0])
        assert "-js" in cmd and cmd[cmd.index("--cluster_name") + 1] == "zml"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        # routes to the two others, by their compose names
        assert sorted(r.split("//")[1].split(":")[0] for r in routes) == sorted(n for n in servers if n != name)
    assert len(names) == 3 and len(volumes) == 3  # distinct JetStream names and stores
    for url in CLUSTER_URLS.split(","):
        assert url.split("//")[1].split(":")[0] in servers
    for name in ("health", "warmup"):
        assert "--ha" in SERVICES[name]["command"] and SERVICES[name]["deploy"]["replicas"] >= 2


def test_nats_runs_with_authorization_and_each_service_with_its_identity() -> None:
    from zml.cli import build_parser

    creds = SERVICES["creds"]
    ns = build_parser().parse_args(creds["command"])
    assert (ns.command, ns.verb, ns.data_dir) == ("creds", "init", "/zml")
    nats = SERVICES["nats"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    assert conf == "/zml/nats.conf"  # written by `zml creds init --data-dir /zml`
    assert nats["depends_on"]["creds"]["condition"] == "service_completed_successfully"
    assert any(v.startswith("zml-auth:/zml") for v in nats["volumes"])
    for name in ("health", "warmup", "router", "gateway"):
        svc = SERVICES[name]
        assert svc["environment"]["ZML_NATS_NKEY"] == f"/zml/creds/{name}.nk", name
        assert "zml-auth:/zml:ro" in svc["volumes"], name


def test_creds_init_writes_what_compose_mounts(tmp_path: Path) -> None:
    from zml.cli import main

    assert main(["creds", "init", "--data-dir", str(tmp_path)]) == 0
    assert (tmp_path / "nats.conf").is_file() and (tmp_path / "auth.conf").is_file()
    for name in ("health", "warmup", "router", "gateway", "admin"):
        assert (tmp_path / "creds" / f"{name}.nk").stat().st_mode & 0o777 == 0o600
