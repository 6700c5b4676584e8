"""The fleet as changed at run time (issue 10 items 2, 6, 7, 8): a node added with
`zml nodes add --family Edge` is routable by a chain naming Edge and `zml.Policy` validates Edge
against the fleet; one added with `--served-name` is sent the engine's name and answers with the
name the client asked for; a price of 0 set with `zml cost set` makes a node free."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import zml
from conftest import MODEL, Stack, launch_stack
from zmlcore.runtime.launch import free_port, spawn

EDGE_MODEL = "edge/tiny-llama"
ENGINE_NAME = "/models/tiny-llama.Q4_K_M.gguf"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("runtime"), routers=2, poll_s=0.3,
                     fleet=[("h100-a", "nvidia_h100", [MODEL]), ("mi300x-a", "amd_mi300x", [MODEL])])
    try:
        yield s
    finally:
        s.stop()


def zml_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zml.cli", *args], capture_output=True, text=True, timeout=60)


def wait_node(stack: Stack, node_id: str, model: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        nodes = {n["node_id"]: n for n in httpx.get(stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"]}
        n = nodes.get(node_id)
        if n is not None and n.get("status") == "up" and model in n.get("models", []):
            return n
        assert time.monotonic() < deadline, f"{node_id} not up with {model}: {n}"
        time.sleep(0.2)


def _sim(stack: Stack, name: str, node_id: str, model: str) -> int:
    port = free_port()
    sim = spawn(name, [sys.executable, "-m", "zml_sim", "--accelerator", "nvidia_a100", "--port", str(port),
                       "--node-id", node_id, "--model", model, "--time-scale", "20", "--load-time-s", "0.1"])
    stack.procs[name] = sim
    assert sim.wait_for("ready", 30), sim.tail()
    return port


@pytest.fixture(scope="module")
def edge(stack: Stack) -> Iterator[str]:
    """A node of a family no zml.toml names (item 6)."""
    port = _sim(stack, "sim-edge", "edge-1", EDGE_MODEL)
    out = zml_cli("nodes", "add", "edge-1", "--accelerator", "nvidia_a100", "--url", f"http://127.0.0.1:{port}",
                  "--serves", EDGE_MODEL, "--family", "Edge", "--nats-url", stack.nats_url)
    assert out.returncode == 0, out.stderr
    assert wait_node(stack, "edge-1", EDGE_MODEL)["family"] == "Edge"
    return "edge-1"


def test_served_names_from_the_cli_reach_the_engine_and_stay_hidden(stack: Stack) -> None:
    # Items 8 and 2: the engine knows the model by a file path; clients never see that path.
    port = _sim(stack, "sim-path", "path-1", ENGINE_NAME)
    out = zml_cli("nodes", "add", "path-1", "--accelerator", "nvidia_a100", "--url", f"http://127.0.0.1:{port}",
                  "--serves", EDGE_MODEL, "--served-name", f"{EDGE_MODEL}={ENGINE_NAME}", "--family", "Paths",
                  "--nats-url", stack.nats_url)
    assert out.returncode == 0, out.stderr
    node = wait_node(stack, "path-1", EDGE_MODEL)
    assert node["served_names"] == {EDGE_MODEL: ENGINE_NAME}
    body = {"model": EDGE_MODEL, "messages": CHAT, "max_tokens": 3, "accelerator_id": "path-1"}
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["zml"]["node_id"] == "path-1" and r.json()["model"] == EDGE_MODEL
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all(ch["model"] == EDGE_MODEL for ch in chunks)
    assert zml_cli("nodes", "remove", "path-1", "--nats-url", stack.nats_url).returncode == 0


def test_served_name_needs_a_served_model(stack: Stack) -> None:
    out = zml_cli("nodes", "add", "x-1", "--accelerator", "nvidia_a100", "--url", "http://127.0.0.1:9",
                  "--serves", MODEL, "--served-name", "other=/x.gguf", "--nats-url", stack.nats_url)
    assert out.returncode != 0 and "--served-name" in out.stderr
    out = zml_cli("nodes", "add", "x-1", "--accelerator", "nvidia_a100", "--url", "http://127.0.0.1:9",
                  "--serves", MODEL, "--served-name", "no-equals-sign", "--nats-url", stack.nats_url)
    assert out.returncode != 0 and "MODEL=ENGINE_NAME" in out.stderr


def test_a_chain_naming_a_run_time_family_routes(stack: Stack, edge: str) -> None:
    body = {"model": EDGE_MODEL, "messages": CHAT, "max_tokens": 3, "policy": {"accelerator_chain": ["Edge"]}}
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as c:
        for _ in range(4):  # both routers (a queue group) know the family
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["zml"]["node_id"] == edge and r.json()["zml"]["family"] == "Edge"
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            assert any(line.startswith("data: {") for line in s.iter_lines())
        bad = c.post("/v1/chat/completions", json={**body, "policy": {"accelerator_chain": ["Nowhere"]}})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "POLICY_CONFIG"


def test_sdk_policy_validates_against_the_fleet(stack: Stack, edge: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no zml.toml here: the fleet is ZML_ENDPOINT
    monkeypatch.setenv("ZML_ENDPOINT", stack.gateway_url)
    policy = zml.Policy(name="edge-only", accelerator_chain=["Edge"])
    with pytest.raises(zml.PolicyConfigError, match="Nowhere"):
        zml.Policy(name="typo", accelerator_chain=["Nowhere"])
    with zml.Client(max_retries=0) as client:
        r = client.infer(EDGE_MODEL, "hi", max_tokens=2, policy=policy)
    assert r.routing.node_id == edge and r.model == EDGE_MODEL
    # A zml.toml that does not name Edge: its gateway is asked.
    (tmp_path / "zml.toml").write_text(
        f'[gateway]\nport = {stack.gateway_url.rsplit(":", 1)[1]}\n[[nodes]]\nid = "h"\naccelerator = "nvidia_h100"\n'
        'endpoint = "http://127.0.0.1:1"\n')
    monkeypatch.delenv("ZML_ENDPOINT")
    zml.Policy(name="edge-2", accelerator_chain=["H100", "Edge"])
    with pytest.raises(zml.PolicyConfigError):
        zml.Policy(name="typo-2", accelerator_chain=["H100", "Nowhere"])


@pytest.mark.parametrize("scheme", ["nats", "grpc"])
def test_sdk_policy_asks_the_fleet_over_nats_and_grpc(stack: Stack, edge: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    # ZML_ENDPOINT may name any transport: the fleet is asked through the client of that scheme.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZML_ENDPOINT", stack.nats_url if scheme == "nats" else f"grpc://{stack.grpc_target}")
    zml.Policy(name=f"edge-{scheme}", accelerator_chain=["Edge"])
    with pytest.raises(zml.PolicyConfigError, match="Nowhere"):
        zml.Policy(name=f"typo-{scheme}", accelerator_chain=["Edge", "Nowhere"])


def test_a_price_of_zero_makes_a_node_free(stack: Stack) -> None:
    def cost_picks() -> Counter:
        picks: Counter = Counter()
        with httpx.Client(base_url=stack.gateway_url, timeout=30) as c:
            for _ in range(6):
                r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                          "policy": "cost"})
                assert r.status_code == 200, r.text
                picks[r.json()["zml"]["node_id"]] += 1
        return picks

    before = cost_picks()
    target = next(n for n in ("h100-a", "mi300x-a") if before[n] < 6)
    out = zml_cli("cost", "set", target, "0", "--nats-url", stack.nats_url)
    assert out.returncode == 0, out.stderr
    try:
        deadline = time.monotonic() + 15
        while True:
            nodes = {n["node_id"]: n for n in httpx.get(stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"]}
            if nodes[target]["cost_per_hour"] == 0:
                break
            assert time.monotonic() < deadline, nodes[target]
            time.sleep(0.2)
        time.sleep(0.5)  # the routers' cost watches (they see it as the gateway does)
        after = cost_picks()
        assert set(after) == {target}, (before, after)
    finally:
        assert zml_cli("cost", "clear", target, "--nats-url", stack.nats_url).returncode == 0
