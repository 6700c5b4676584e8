"""A node whose engine names the model its own way (a vLLM started from a local path)."""

from __future__ import annotations

import json
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
