"""A node whose engine names the model its own way (a vLLM started from a local path), and one
added without saying so (a llama-server whose ``--alias`` is not the fleet's name)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from conftest import MODEL, Stack, launch_stack
from zmlcore.runtime.launch import free_port, spawn

ENGINE_NAME = "/models/Meta-Llama-3-8B-Instruct"


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The path-named node is a plain sim (not in [nodes.sim]): it serves ENGINE_NAME only.
    port = free_port()
    sim = spawn("sim-path", [sys.executable, "-m", "zml_sim", "--accelerator", "amd_mi300x", "--port", str(port),
                             "--node-id", "mi300x-path", "--model", ENGINE_NAME, "--time-scale", "20",
                             "--load-time-s", "0.1"])
    assert sim.wait_for("ready", 30), sim.tail()
    extra = (f'[[nodes]]\nid = "mi300x-path"\naccelerator = "amd_mi300x"\nendpoint = "http://127.0.0.1:{port}"\n'
             f'models = ["{MODEL}"]\nserved_names = {{ "{MODEL}" = "{ENGINE_NAME}" }}\n')
    s = launch_stack(own_nats, tmp_path_factory.mktemp("served"), fleet=[("h100-a", "nvidia_h100", [MODEL])],
                     routers=1, poll_s=0.3, extra=extra)
    s.procs["sim-path"] = sim
    # A llama-server started with --alias mid: nothing in the fleet is called that.
    s.node_ports["cpu-mid"] = free_port()
    mid = spawn("sim-mid", [sys.executable, "-m", "zml_sim", "--accelerator", "cpu", "--engine", "llamacpp",
                            "--port", str(s.node_ports["cpu-mid"]), "--node-id", "cpu-mid", "--model", "mid",
                            "--time-scale", "20", "--load-time-s", "0.1"])
    s.procs["sim-mid"] = mid
    assert mid.wait_for("ready", 30), mid.tail()
    try:
        yield s
    finally:
        s.stop()


def test_requests_carry_the_engines_name_and_state_reports_zmls(stack: Stack) -> None:
    with httpx.Client(base_url=stack.gateway_url, timeout=20) as c:
        nodes = {n["node_id"]: n for n in c.get("/v1/nodes").json()["nodes"]}
        assert nodes["mi300x-path"]["models"] == [MODEL]  # ZML's name, not the path
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "accelerator_id": "mi300x-path"})
        assert r.status_code == 200, r.text
        assert r.json()["zml"]["node_id"] == "mi300x-path"
        # The engine answered for the name it knows; the client reads back the name it asked for
        # (issue 10 item 2), in a plain reply and in every streamed chunk.
        assert r.json()["model"] == MODEL
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "accelerator_id": "mi300x-path", "stream": True}) as s:
            assert s.status_code == 200
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert chunks and all(ch["model"] == MODEL for ch in chunks)


def _zml(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zml.cli", *args], capture_output=True, text=True, timeout=60)


def test_a_node_added_without_the_engines_name_says_so_and_its_alias_stays_private(stack: Stack) -> None:
    """Issue 27 item 3: `zml nodes add ... --serves MODEL` on an engine that calls the model "mid"."""
    url = stack.sim_url("cpu-mid")
    add = ["nodes", "add", "cpu-mid", "--accelerator", "cpu", "--backend", "llama.cpp", "--url", url,
           "--serves", MODEL, "--nats-url", stack.nats_url]
    p = _zml(*add)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stdout.startswith("cpu-mid: added (cpu at ") and "serving nothing yet" in p.stdout, p.stdout
    assert f"does not serve {MODEL!r}: its engine calls its models 'mid'" in p.stderr, p.stderr
    assert f"--served-name {MODEL}=mid --replace" in p.stderr, p.stderr
    try:
        with httpx.Client(base_url=stack.gateway_url, timeout=20) as c:
            node = next(n for n in c.get("/v1/nodes").json()["nodes"] if n["node_id"] == "cpu-mid")
            assert node["status"] == "up" and node.get("models", []) == []
            assert node["missing_models"] == [MODEL] and node["unknown_models"] == ["mid"]
            assert f"--served-name {MODEL}=mid --replace" in node["note"], node["note"]
            # the engine's alias is no public model
            assert "mid" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert c.get("/v1/models/mid").status_code == 404
        table = _zml("nodes", "--endpoint", stack.gateway_url).stdout
        row = next(line for line in table.splitlines() if line.startswith("cpu-mid"))
        assert f"(missing: {MODEL})" in row, table
        # told the engine's name, it serves the model
        p = _zml(*add, "--served-name", f"{MODEL}=mid", "--replace")
        assert p.returncode == 0 and p.stdout.rstrip().endswith(f"serving {MODEL}") and not p.stderr, (p.stdout,
                                                                                                     p.stderr)
    finally:
        _zml("nodes", "remove", "cpu-mid", "--nats-url", stack.nats_url)
