"""A whole ZML stack for chaos scenarios: every process started here, by PID, so a scenario can
``kill -9`` any of them and start it again.

Shape: a nats-server of its own (killable, restartable on the same port with the same store
dir) or a 3-server cluster; the sim fleet split so that one node (``VICTIM``) runs in a process
of its own; health, warmup, routers and gateways as separate services, started as `zml up` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats

from conftest import MODEL, fleet_toml, wait_ready
from zmlcore import subjects
from zmlcore.runtime.launch import Proc, free_port, nats_server_binary, service_argv, spawn, wait_port

FLEET = [
    ("h100-a", "nvidia_h100", [MODEL]),
    ("h100-b", "nvidia_h100", [MODEL]),
    ("mi300x-a", "amd_mi300x", [MODEL]),
    ("a100-a", "nvidia_a100", [MODEL]),
]
#: The node that runs in a sim process of its own (so it can be killed alone).
VICTIM = "h100-b"


@dataclass
class NatsServer:
    """One nats-server with a fixed port and store dir: kill -9 it, start it again."""

    name: str
    port: int
    store: Path
    cluster_port: int | None = None
    routes: list[int] = field(default_factory=list)
    #: HTTP monitoring (/varz, /jsz) on this port, if set (the soak bench reads it).
    monitor_port: int | None = None
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        argv = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store),
                "--server_name", self.name]
        if self.cluster_port is not None:
            argv += ["--cluster_name", "zml-chaos", "--cluster", f"nats://127.0.0.1:{self.cluster_port}",
                     "--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        if self.monitor_port is not None:
            argv += ["-m", str(self.monitor_port)]
        return argv

    def start(self, wait: bool = True) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.proc = spawn(self.name, self.argv())
        if wait and not wait_port("127.0.0.1", self.port, 20):
            raise RuntimeError(f"{self.name} did not start:\n{self.proc.tail()}")

    def kill(self) -> None:
        assert self.proc is not None
        kill9(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def kill9(proc: Proc) -> None:
    """SIGKILL one process the test started, by its PID, and reap it."""
    if proc.alive():
        os.kill(proc.pid, signal.SIGKILL)
    try:
        proc.popen.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass


def start_cluster(base: Path, n: int = 3) -> list[NatsServer]:
    ports = [free_port() for _ in range(n)]
    cports = [free_port() for _ in range(n)]
    servers = [NatsServer(f"nats-{i + 1}", ports[i], base / f"n{i + 1}", cports[i],
                          [p for j, p in enumerate(cports) if j != i]) for i in range(n)]
    for s in servers:
        s.start(wait=False)
    for s in servers:
        if not wait_port("127.0.0.1", s.port, 20):
            raise RuntimeError(f"{s.name} did not start:\n{s.proc.tail() if s.proc else ''}")
    return servers


@dataclass
class ChaosStack:
    tmp: Path
    nats_urls: list[str]
    routers: int = 2
    gateways: int = 1
    health: int = 1
    warmup: int = 0
    #: Batch runners (the Batch API's work), none unless a scenario needs them.
    batch: int = 0
    time_scale: float = 5.0
    extra_toml: str = ""
    health_toml: dict[str, Any] = field(default_factory=dict)
    router_toml: str = "cooldown_s = 5\n"
    sim_extra: str = ""
    procs: dict[str, Proc] = field(default_factory=dict)
    gateway_ports: list[int] = field(default_factory=list)
    node_ports: dict[str, int] = field(default_factory=dict)
    config_path: str = ""

    @property
    def nats_url(self) -> str:
        return ",".join(self.nats_urls)

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.gateway_ports]

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> ChaosStack:
        self.node_ports = {node_id: free_port() for node_id, _, _ in FLEET}
        h = {"poll_s": 0.5, **self.health_toml}
        toml = fleet_toml(self.node_ports, fleet=FLEET, time_scale=self.time_scale, poll_s=h.pop("poll_s"),
                          extra=self.extra_toml, router=self.router_toml, sim_extra=self.sim_extra)
        for key, value in h.items():  # override [health] keys fleet_toml sets
            toml = _set_key(toml, "health", key, value)
        cfg = self.tmp / "zml.toml"
        cfg.write_text(toml)
        self.config_path = str(cfg)
        self.gateway_ports = [free_port() for _ in range(self.gateways)]
        try:
            self._spawn("sim")
            self._spawn(f"sim-{VICTIM}")
            for kind, count in (("health", self.health), ("warmup", self.warmup), ("router", self.routers),
                                ("batch", self.batch), ("gateway", self.gateways)):
                for i in range(1, count + 1):
                    self._spawn(f"{kind}-{i}")
            for port in self.gateway_ports:
                deadline = time.monotonic() + 60
                while not wait_port("127.0.0.1", port, 0.3):
                    dead = [p.name for p in self.procs.values() if not p.alive()]
                    assert not dead and time.monotonic() < deadline, f"not started: {dead or 'gateway'}"
            for url in self.gateway_urls:
                wait_ready(url, MODEL, timeout=90, want_nodes=len(FLEET))
        except BaseException:
            self.dump()
            self.stop()
            raise
        return self

    def _argv(self, name: str) -> list[str]:
        kind = name.split("-")[0]
        if kind == "sim":
            node = name[4:] if name != "sim" else None
            nodes = [node] if node else [n for n, _, _ in FLEET if n != VICTIM]
            return [*service_argv("sim", self.config_path, self.nats_url), "--node", *nodes]
        extra: list[str] = []
        if kind == "router":
            extra = ["--router-id", name]
        elif kind == "batch":
            extra = ["--runner-id", name]
        elif kind == "gateway":
            extra = ["--port", str(self.gateway_ports[int(name.split("-")[1]) - 1])]
        elif kind in ("health", "warmup") and getattr(self, kind) > 1:
            extra = ["--ha"]  # several replicas: one active, holding the leader lease (zml_leases)
        return service_argv(kind, self.config_path, self.nats_url, *extra)

    def _spawn(self, name: str) -> Proc:
        proc = spawn(name, self._argv(name))
        self.procs[name] = proc
        return proc

    def restart(self, name: str, timeout: float = 60.0) -> Proc:
        """Start ``name`` again (stopping it first if alive); a sim or gateway once it listens."""
        old = self.procs.get(name)
        if old is not None and old.alive():
            old.stop()
        proc = self._spawn(name)
        ports: list[int] = []
        if name == "sim":
            ports = [p for n, p in self.node_ports.items() if n != VICTIM]
        elif name.startswith("sim-"):
            ports = [self.node_ports[name[4:]]]
        elif name.startswith("gateway-"):
            ports = [self.gateway_ports[int(name.split("-")[1]) - 1]]
        for port in ports:
            if not wait_port("127.0.0.1", port, timeout):
                raise RuntimeError(f"{name} did not listen again:\n{proc.tail()}")
        return proc

    def kill(self, name: str) -> None:
        kill9(self.procs[name])

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()

    def dump(self, n: int = 25) -> None:
        for p in self.procs.values():
            print(f"--- {p.name} (alive={p.alive()})\n{p.tail(n)}")

    def service_pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items() if p.alive()}

    # --- faults ----------------------------------------------------------------------------
    def sim_url(self, node_id: str) -> str:
        return f"http://127.0.0.1:{self.node_ports[node_id]}"

    def sim_state(self, node_id: str) -> dict[str, Any]:
        return httpx.get(self.sim_url(node_id) + "/sim/state", timeout=10).json()

    def faults(self, node_id: str, **faults: Any) -> None:
        r = httpx.post(self.sim_url(node_id) + "/sim/faults", json=faults, timeout=10)
        assert r.status_code == 200, r.text

    def clear_faults(self, nodes: Iterable[str] | None = None) -> None:
        for node_id in nodes or self.node_ports:
            r = httpx.delete(self.sim_url(node_id) + "/sim/faults", timeout=10)
            assert r.status_code == 200, r.text

    # --- observation -----------------------------------------------------------------------
    async def router_states(self, nc: Any, timeout: float = 2.0) -> dict[str, dict[str, Any]]:
        out = {}
        for name in [n for n, p in self.procs.items() if n.startswith("router") and p.alive()]:
            try:
                msg = await nc.request(subjects.router_state(name), b"", timeout=timeout)
                out[name] = json.loads(msg.data)
            except Exception:  # a router mid-restart, or the broker down: no answer this time
                continue
        return out

    async def node_statuses(self, nc: Any) -> dict[str, str]:
        """Health's view in the KV bucket (what routers follow)."""
        js = nc.jetstream()
        kv = await js.key_value(subjects.NODES_BUCKET)
        out = {}
        for node_id in self.node_ports:
            try:
                entry = await kv.get(node_id)
            except Exception:
                continue
            if entry.value:
                out[node_id] = json.loads(entry.value)["status"]
        return out


def _set_key(toml: str, table: str, key: str, value: Any) -> str:
    """Set ``key`` in the first ``[table]`` of generated TOML (replacing a line fleet_toml wrote)."""
    head = f"[{table}]\n"
    start = toml.index(head) + len(head)
    end = toml.find("\n[", start)
    body = toml[start:end] if end != -1 else toml[start:]
    lines = [line for line in body.split("\n") if line and not line.startswith(f"{key} =")]
    lines.append(f"{key} = {json.dumps(value)}")
    new = "\n".join(lines) + "\n"
    return toml[:start] + new + (toml[end:] if end != -1 else "")


async def nats_connect(urls: list[str]) -> Any:
    return await nats.connect(urls, connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                              allow_reconnect=True)


async def poll_until(pred: Any, timeout: float, every: float = 0.2) -> bool:
    """Poll an (async or plain) predicate until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return True
        await asyncio.sleep(every)
    return False
