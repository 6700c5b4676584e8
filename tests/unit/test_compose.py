"""Docker is not available here: check compose.yaml against what the services accept."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from zmlcore.config import load_config
from zmlcore.launch import endpoint_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PARSERS = {
    "sim": "zmlcore.sim.cli",
    "gateway": "zml_gateway.__main__",
    "router": "zml_router.__main__",
    "health": "zml_health.__main__",
    "warmup": "zml_warmup.__main__",
}
KNOWN_ENV = {"ZML_LOG_LEVEL", "ZML_NATS_URL", "ZML_GATEWAY_HOST", "ZML_GATEWAY_PORT", "ZML_API_KEYS",
             "OTEL_EXPORTER_OTLP_ENDPOINT"}


def _in_repo(path: str) -> Path:
    assert path.startswith("/app/"), path  # the Dockerfile copies the repo to /app
    return ROOT / path[len("/app/"):]


@pytest.mark.parametrize("name", [n for n in SERVICES if n != "nats"])
def test_each_command_parses_with_the_service_cli(name: str) -> None:
    command = SERVICES[name]["command"]
    sub, args = command[0], command[1:]
    assert sub == name
    parser = importlib.import_module(PARSERS[sub]).build_parser()
    ns = parser.parse_args(args)
    assert _in_repo(ns.config).is_file()
    load_config(_in_repo(ns.config), env={})
    if name != "sim":
        assert ns.nats_url == "nats://nats:4222"


def test_env_vars_are_ones_the_services_read() -> None:
    for name, svc in SERVICES.items():
        for var in (svc.get("environment") or {}):
            assert var in KNOWN_ENV, (name, var)


def test_ports_match() -> None:
    gw = SERVICES["gateway"]["command"]
    port = gw[gw.index("--port") + 1]
    assert SERVICES["gateway"]["ports"] == [f"{port}:{port}"]
    assert "-js" in SERVICES["nats"]["command"] and SERVICES["nats"]["ports"] == ["4222:4222"]
    cfg_path = _in_repo(SERVICES["sim"]["command"][2])
    cfg = load_config(cfg_path, env={})
    exposed = set(SERVICES["sim"]["expose"])
    for node in cfg.nodes:
        host, node_port = endpoint_port(node.endpoint)
        assert host == "sim" and str(node_port) in exposed, node.id
    assert cfg.nats.url == "nats://nats:4222"


def test_dockerfile_installs_the_repo_and_runs_zml() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install" in text and 'ENTRYPOINT ["zml"]' in text
    for folder in ("libs", "services", "sdk"):
        assert f"COPY {folder}" in text


def test_every_long_running_service_is_in_compose() -> None:
    assert {"nats", "sim", "health", "warmup", "router", "gateway"} <= set(SERVICES)


def test_every_service_restarts_and_has_a_healthcheck() -> None:
    for name, svc in SERVICES.items():
        assert svc.get("restart") in ("unless-stopped", "always"), name
        check = svc.get("healthcheck")
        assert check and check["test"][0] == "CMD", name
        if name in PARSERS and name != "sim":
            # the file the healthcheck reads is the one the service touches
            ns = importlib.import_module(PARSERS[name]).build_parser().parse_args(svc["command"][1:])
            assert ns.alive_file and ns.alive_file in check["test"], name
            assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
    sim_check = " ".join(SERVICES["sim"]["healthcheck"]["test"])
    assert "/health" in sim_check and any(f"127.0.0.1:{p}" in sim_check for p in SERVICES["sim"]["expose"])
