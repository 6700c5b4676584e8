"""Fixtures for the real-engine suite (imported by its test modules: a second conftest.py would
clash with tests/conftest.py): llama-server processes serving the tiny generated model,
in a ZML fleet beside `zml sim` nodes, started the way `zml up` starts the services.

Run with ``python -m pytest -m engine`` (``.ci/llama-server`` gets the engine). Without it every
test here skips, saying what is missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import llamaserver
from conftest import MODEL, Stack, launch_stack
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn

#: The real nodes' engine name for MODEL (llama-server --alias): served_names maps it.
SERVED = "tiny-llama"
SLEEP_IDLE_S = 2
#: An embedding model: llama-server --embeddings (mean pooling) on the same tiny llama.
EMBED = "tiny/embed"
EMBED_SERVED = "tiny-embed"
SIM_FLEET = [("h100-1", "nvidia_h100", [MODEL]), ("a100-1", "nvidia_a100", [MODEL])]
POLICIES = (
    '[policies.cpu-only]\naccelerator_chain = ["CPU"]\nlatency_target_ms = 60000\n'
    '[policies.gpu-only]\naccelerator_chain = ["H100", "A100"]\nlatency_target_ms = 60000\n'
    f'[models."{EMBED}"]\nembedding = true\n'
)


@dataclass
class Llama:
    binary: str
    model: Path


@pytest.fixture(scope="session")
def llama() -> Llama:
    reason = llamaserver.unavailable()
    if reason:
        pytest.skip(reason)
    binary = llamaserver.llama_server_binary()
    vocab = llamaserver.vocab_file()
    assert binary and vocab
    return Llama(binary, llamaserver.cached_model(vocab))


@dataclass
class RealNode:
    node_id: str
    port: int
    extra: tuple[str, ...] = ()
    alias: str = SERVED
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, llama: Llama) -> None:
        self.proc = llamaserver.start_server(self.node_id, llama.binary, llama.model, self.port, *self.extra,
                                             alias=self.alias)
        llamaserver.wait_healthy(self.url, self.proc)

    def kill(self) -> None:
        """SIGKILL: a crash, not a clean stop."""
        if self.proc is not None and self.proc.alive():
            self.proc.popen.kill()
            self.proc.popen.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def real_node_toml(node: RealNode, *, startup_grace_s: float = 5.0, family: str = "", model: str = MODEL) -> str:
    fam = f'family = "{family}"\n' if family else ""
    return (f'[[nodes]]\nid = "{node.node_id}"\naccelerator = "cpu"\nbackend = "llamacpp"\n{fam}'
            f'endpoint = "{node.url}"\nmodels = ["{model}"]\nstartup_grace_s = {startup_grace_s}\n'
            f'[nodes.served_names]\n"{model}" = "{node.alias}"\n')


@dataclass
class EngineFleet:
    stack: Stack
    llama: Llama
    real: dict[str, RealNode] = field(default_factory=dict)
    late: RealNode | None = None

    def nodes(self) -> dict[str, dict[str, Any]]:
        rows = httpx.get(self.stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"]
        return {n["node_id"]: n for n in rows}

    def wait_node(self, node_id: str, pred: Any, timeout: float = 60.0, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            last = self.nodes().get(node_id, {})
            if last and pred(last):
                return last
            time.sleep(0.2)
        raise AssertionError(f"{node_id}: {what or 'condition'} not reached in {timeout:g} s; last: {last}")

    def chat(self, *, max_tokens: int = 16, timeout: float = 60.0, content: str = "Say something.",
             **zml: Any) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **zml}
        return httpx.post(self.stack.gateway_url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def engine_fleet(llama: Llama, own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFleet]:
    """Two real llama-server nodes (CPU family) and two sims (H100, A100), one ZML model; a
    third llama-server that sleeps after 2 idle seconds, in a family of its own (SLEEPY) so that
    only requests pinned to it wake it; a fourth serving embeddings (EMBED)."""
    real = {n: RealNode(n, free_port()) for n in ("llama-1", "llama-2")}
    real["llama-sleepy"] = RealNode("llama-sleepy", free_port(), ("--sleep-idle-seconds", str(SLEEP_IDLE_S)))
    real["llama-embed"] = RealNode("llama-embed", free_port(), ("--embeddings", "--pooling", "mean"),
                                   alias=EMBED_SERVED)
    for node in real.values():
        node.start(llama)
    stack = None
    fleet: EngineFleet | None = None
    try:
        extra = POLICIES + "\n" + "".join(
            real_node_toml(n, family="SLEEPY" if n.node_id == "llama-sleepy" else "",
                           model=EMBED if n.node_id == "llama-embed" else MODEL) for n in real.values())
        # Registered but not started: "loading" (never answered, in its start-up grace window)
        # until a test starts it.
        late = RealNode("llama-late", free_port())
        extra += real_node_toml(late, startup_grace_s=600, family="LATE")
        stack = launch_stack(own_nats, tmp_path_factory.mktemp("engine"), fleet=SIM_FLEET, extra=extra,
                             poll_s=0.5)
        fleet = EngineFleet(stack, llama, real)
        fleet.late = late
        for node_id in real:
            fleet.wait_node(node_id, lambda n: n["status"] == "up" and n["models"], what="up")
        yield fleet
    finally:
        if stack is not None:
            stack.stop()
        for node in [*real.values(), *([fleet.late] if fleet is not None and fleet.late else [])]:
            node.stop()


#: Two llamas of unequal speed for one model (llamaserver.FAST / SLOW: ~3.5x apart at prefill).
UNEQUAL = {"llama-fast": llamaserver.FAST, "llama-slow": llamaserver.SLOW}


def server_toml(server: llamaserver.Server, *, model: str = MODEL, alias: str = SERVED) -> str:
    """A llama-server of ``unequal_fleet`` as a zml.toml node: accelerator cpu, backend llamacpp."""
    return (f'[[nodes]]\nid = "{server.node_id}"\naccelerator = "cpu"\nbackend = "llamacpp"\n'
            f'endpoint = "{server.url}"\nmodels = ["{model}"]\n[nodes.served_names]\n"{model}" = "{alias}"\n')


def launch_real_stack(nats_url: str, tmp: Path, servers: list[llamaserver.Server], *, routers: int = 1,
                      poll_s: float = 0.5, policy: str = "latency", extra: str = "") -> Stack:
    """Health, routers and the gateway over real llama-servers only (no sims), started as `zml up`
    starts them, ``policy`` the default for requests that name none. Nothing is sent through it:
    the fleet is cold (every node on its type's default speeds) until the caller's first request."""
    config = tmp / "zml.toml"
    config.write_text(f'[defaults]\nrequest_timeout_s = 60\npolicy = "{policy}"\n'
                      f"[health]\npoll_interval_s = {poll_s}\nkv_heartbeat_s = {poll_s}\nprobe_timeout_s = 2.0\n"
                      # the tests' prompts are ~1,000-1,700 tokens, and a toy model's speeds fall
                      # with the context (attention outweighs its 64-wide layers): 512 tokens read
                      # 2x the speed of the prompts routed (docs/health.md)
                      "calibrate_prompt_tokens = 1024\n"
                      f"{extra}\n" + "".join(server_toml(s) for s in servers))
    gw_port = free_port()
    stack = Stack(f"http://127.0.0.1:{gw_port}", nats_url, str(config), MODEL, [s.node_id for s in servers],
                  {s.node_id: s.port for s in servers})
    try:
        stack.metrics_ports["health"] = free_port()
        stack.procs["health"] = spawn("health", service_argv("health", str(config), nats_url, "--metrics-port",
                                                             str(stack.metrics_ports["health"])))
        for i in range(1, routers + 1):
            stack.start_router(f"router-{i}")
        stack.procs["gateway"] = spawn("gateway", service_argv("gateway", str(config), nats_url, "--port",
                                                               str(gw_port)))
        deadline = time.monotonic() + 60
        want = {s.node_id for s in servers}
        while True:
            dead = [p.name for p in stack.procs.values() if not p.alive()]
            assert not dead, f"exited: {dead}"
            try:
                rows = httpx.get(stack.gateway_url + "/v1/nodes", timeout=2).json()["nodes"]
                if want <= {n["node_id"] for n in rows if n["status"] == "up" and MODEL in n["models"]}:
                    return stack
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "real nodes not up in 60 s"
            time.sleep(0.2)
    except BaseException:
        for p in stack.procs.values():
            print(f"--- {p.name}\n{p.tail(30)}")
        stack.stop()
        raise
