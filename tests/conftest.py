"""Shared fixtures: a real nats-server (JetStream, free port) per session, and the whole ZML
stack (sim fleet + health + two routers + gateway) started the way `zml up` starts it.

With ZML_TEST_DOCKER=1 and a Docker engine, NATS comes from testcontainers' NATS image.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from zmlcore.launch import Proc, free_port, service_argv, spawn, start_nats, wait_port

MODEL = "meta-llama/llama-3-8b-instruct"
MODEL_2 = "mistralai/mistral-7b-instruct"

# The demo fleet's shape, fast: the sims run 20x real time and load in well under a second.
FLEET = [
    ("h100-1", "nvidia_h100", [MODEL, MODEL_2]),
    ("h100-2", "nvidia_h100", [MODEL]),
    ("a100-1", "nvidia_a100", [MODEL]),
    ("mi300x-1", "amd_mi300x", [MODEL, MODEL_2]),
    ("mi300x-2", "amd_mi300x", [MODEL]),
    ("gaudi2-1", "intel_gaudi2", [MODEL]),
]


def fleet_toml(ports: dict[str, int], *, time_scale: float = 20.0, poll_s: float = 0.5, extra: str = "") -> str:
    out = [
        "[defaults]\nrequest_timeout_s = 20\n",
        f"[health]\npoll_interval_s = {poll_s}\nprobe_timeout_s = 1.0\ndown_after = 2\nup_after = 1\n",
        "[router]\ncooldown_s = 2\n",
        f'[models."{MODEL}"]\naliases = ["llama-3-8b"]\n',
        '[policies.llama3-production]\naccelerator_chain = ["H100", "MI300X", "A100"]\n'
        'latency_target_ms = 500\ncost_priority = "balanced"\n',
        extra,
    ]
    for node_id, acc, models in FLEET:
        models_toml = ", ".join(f'"{m}"' for m in models)
        out.append(
            f'[[nodes]]\nid = "{node_id}"\naccelerator = "{acc}"\n'
            f'endpoint = "http://127.0.0.1:{ports[node_id]}"\nmodels = [{models_toml}]\n'
            f"[nodes.sim]\ntime_scale = {time_scale}\nload_time_s = 2.0\nseed = {len(out)}\n"
        )
    return "\n".join(out)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if os.environ.get("ZML_TEST_DOCKER") == "1":
        from testcontainers.nats import NatsContainer

        with NatsContainer("nats:2.10", jetstream=True) as container:
            yield container.nats_uri()
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-test-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.stop()


@dataclass
class Stack:
    gateway_url: str
    nats_url: str
    config_path: str
    model: str
    node_ids: list[str]
    node_ports: dict[str, int]
    procs: dict[str, Proc] = field(default_factory=dict)

    def sim_url(self, node_id: str) -> str:
        return f"http://127.0.0.1:{self.node_ports[node_id]}"


def wait_ready(gateway_url: str, model: str, timeout: float = 60.0, want_nodes: int = 1) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                nodes = client.get(gateway_url + "/v1/nodes").json()["nodes"]
                up = [n for n in nodes if n.get("status") == "up" and model in n.get("models", [])]
                if len(up) >= want_nodes:
                    r = client.post(gateway_url + "/v1/chat/completions",
                                    json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                    if r.status_code == 200:
                        return
                    last = r.text
                else:
                    last = f"{len(up)} nodes up"
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.2)
    raise RuntimeError(f"stack not ready: {last}")


@pytest.fixture(scope="session")
def zml_stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("stack")
    ports = {node_id: free_port() for node_id, _, _ in FLEET}
    config = tmp / "zml.toml"
    config.write_text(fleet_toml(ports))
    gw_port = free_port()
    procs: dict[str, Proc] = {}
    try:
        procs["sim"] = spawn("sim", service_argv("sim", str(config), nats_url))
        procs["health"] = spawn("health", service_argv("health", str(config), nats_url))
        for i in (1, 2):
            procs[f"router-{i}"] = spawn(f"router-{i}", service_argv("router", str(config), nats_url, "--router-id", f"router-{i}"))
        procs["gateway"] = spawn("gateway", service_argv("gateway", str(config), nats_url, "--port", str(gw_port)))
        assert wait_port("127.0.0.1", gw_port, 30), procs["gateway"].tail()
        url = f"http://127.0.0.1:{gw_port}"
        try:
            wait_ready(url, MODEL, want_nodes=len(FLEET))
        except RuntimeError:
            for p in procs.values():
                print(f"--- {p.name}\n{p.tail(30)}")
            raise
        yield Stack(url, nats_url, str(config), MODEL, [f[0] for f in FLEET], ports, procs)
    finally:
        for p in reversed(list(procs.values())):
            p.stop()
