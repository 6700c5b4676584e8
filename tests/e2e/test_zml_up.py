"""`zml up` as a user runs it: one command, a ready line, a working request, a clean stop."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest

from zmlcore.runtime.launch import Proc, free_port, listen_ports, port_in_use, spawn, wait_port
from zml.cli.up import demo_config_path
from zmlcore.config import load_config
from zmlcore.runtime.launch import endpoint_port
from zmlcore.runtime.sizing import nats_gomaxprocs, usable_cores


def _zml(*args: str) -> list[str]:
    return [sys.executable, "-m", "zml.cli", *args]


def _port_base(n: int) -> int:
    """A run of n free ports for --sim-port-base (below the ephemeral range, see listen_ports)."""
    return listen_ports(n)


def test_zml_up_port_in_use_is_one_clear_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(_zml("up", "--gateway-port", str(port), "--nats-port", str(free_port())),
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "already in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_zml_up_bad_config_names_file_and_key(tmp_path) -> None:
    bad = tmp_path / "zml.toml"
    bad.write_text('[[nodes]]\nid = "n1"\naccelerator = "nvidia_h200"\nendpoint = "http://127.0.0.1:1"\n')
    out = subprocess.run(_zml("up", "--config", str(bad)), capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert str(bad) in out.stderr and "nodes[0].accelerator" in out.stderr and "nvidia_h200" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("service", ["gateway", "router", "health"])
def test_each_service_has_a_cli(service: str) -> None:
    out = subprocess.run(_zml(service, "--help"), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and "--nats-url" in out.stdout


@pytest.mark.timeout(240)
def test_zml_up_says_when_a_node_goes_down_and_comes_back(tmp_path: Path) -> None:
    """Issue 27 item 4: a node's engine killed under `zml up` (the secure default: the watch reads
    the health service as the folder's admin identity): one line when it goes down, with the
    health service's reason, and one when it is back."""
    from conftest import MODEL, fleet_toml

    fleet = [("h100-1", "nvidia_h100", [MODEL]), ("a100-1", "nvidia_a100", [MODEL])]
    ports = {node_id: free_port() for node_id, _, _ in fleet}
    config = tmp_path / "zml.toml"
    config.write_text(fleet_toml(ports, fleet=fleet))
    gw, nats_port = free_port(), free_port()
    proc = spawn("zml-up", _zml("up", "--config", str(config), "--gateway-port", str(gw), "--nats-port",
                                str(nats_port), "--data-dir", str(tmp_path / "data"), "--routers", "1",
                                "--standby", "0"))
    try:
        assert proc.wait_for("zml ready", 150), proc.tail(40)
        deadline = time.monotonic() + 60
        while {n["status"] for n in httpx.get(f"http://127.0.0.1:{gw}/v1/nodes", timeout=10).json()["nodes"]} != {"up"}:
            assert time.monotonic() < deadline, proc.tail(40)
            time.sleep(0.5)
        time.sleep(2)  # the watch has seen them up
        r = httpx.post(f"http://127.0.0.1:{ports['a100-1']}/sim/faults", json={"crash": True, "crash_for_s": 4},
                       timeout=5)
        assert r.status_code == 200, r.text
        assert proc.wait_for("zml up: node a100-1 down: ", 30), proc.tail(40)
        assert proc.wait_for("zml up: node a100-1 up again (out for ", 60), proc.tail(40)
        down = next(line for line in proc.lines if "node a100-1 down: " in line)
        assert "ConnectError" in down or "refused" in down, down  # the probe's own words
        assert re.search(r"\(last answered \d+\.\d s ago\)$", down), down
        assert not any("node h100-1" in line for line in proc.lines), proc.tail(40)  # nothing about the other
    finally:
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(60) == 0, proc.tail(40)


# The two `zml up` last in the file: the fixture stops them after the last test that reads them.
@dataclass
class Run:
    proc: Proc
    gw: int
    nats_port: int
    data: Path


@dataclass
class TwoUps:
    secure: Run  # free ports, the secure default
    based: Run  # --sim-port-base, and --insecure (test_zml_up_insecure_is_an_explicit_open_broker)
    base: int
    used: list[tuple[str, int]] = field(default_factory=list)  # every port either used: free after


@pytest.fixture(scope="module")
def two_ups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoUps]:
    """Two `zml up` on one machine, read by two tests (each `zml up` is ~15 processes to start).
    Stopping them is checked here: both exit 0 on SIGTERM and free every port they used."""
    tmp_path = tmp_path_factory.mktemp("two-ups")
    cfg = load_config(demo_config_path())
    base = _port_base(len(cfg.nodes))
    runs: list[Run] = []
    # Both at once: the based run's ports were claimed above in the machine-wide port record
    # (zmlcore.runtime.portbook, what listen_ports consults), so the free-port run, picking its
    # ports in another process, does not pick one of them (it once did, before that record; the
    # based run then started first and the other only once its nodes listened: ~4 s more).
    for k, extra in ((1, ("--sim-port-base", str(base), "--insecure")), (0, ())):
        gw, nats_port = free_port(), free_port()
        data = tmp_path / f"zml-data-{k}"  # each its own identities and store
        proc = spawn(f"zml-up-{k}", _zml("up", "--gateway-port", str(gw), "--nats-port", str(nats_port),
                                         "--data-dir", str(data), *extra))
        runs.insert(0, Run(proc, gw, nats_port, data))
    ups = TwoUps(runs[0], runs[1], base)
    try:
        for run in runs:
            assert run.proc.wait_for("zml ready", 150), run.proc.tail()
        yield ups
    finally:
        for run in runs:
            run.proc.popen.send_signal(signal.SIGTERM)
        for run in runs:
            assert run.proc.popen.wait(30) == 0, run.proc.tail()
    # Every child is gone: the ports they used are free again.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(port_in_use(h, p) for h, p in ups.used):
        time.sleep(0.2)
    assert not [p for h, p in ups.used if port_in_use(h, p)]


@pytest.mark.timeout(300)
def test_two_zml_up_on_one_machine_run_the_demo_fleet_and_stop_everything(two_ups: TwoUps) -> None:
    # Issue 10 item 11: the demo fleet used to bind 9101-9107 always, so a second `zml up`
    # failed with "port 9101 ... already in use". Now one picks free ports, the other a base.
    cfg = load_config(demo_config_path())
    base = two_ups.base
    used = two_ups.used
    endpoints = []
    for run in (two_ups.secure, two_ups.based):
        proc, gw, nats_port = run.proc, run.gw, run.nats_port
        ready = next(line for line in proc.lines if "zml ready" in line)
        assert f"http://127.0.0.1:{gw}" in ready
        r = httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", timeout=30,
                       json={"model": "meta-llama/llama-3-8b-instruct",
                             "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["zml"]["node_id"] in {n.id for n in cfg.nodes}
        # "ready" comes with the first node; the others are published as their first probe
        # answers (a loaded CI box: seconds later)
        want = {"nvidia_h100", "nvidia_a100", "amd_mi300x", "intel_gaudi2"}
        deadline = time.monotonic() + 60
        while True:
            nodes = httpx.get(f"http://127.0.0.1:{gw}/v1/nodes", timeout=10).json()["nodes"]
            if {n["accelerator_type"] for n in nodes} >= want or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {n["accelerator_type"] for n in nodes} >= want
        endpoints.append({n["node_id"]: n["endpoint"] for n in nodes})
        # Prometheus /metrics: the gateway on its own port, health, warmup (two of each, one
        # active) and the router on ports of their own (free ones by default, so two `zml up`
        # do not clash), printed.
        line = next(line for line in proc.lines if line.startswith("zml metrics:"))
        ports = dict(re.findall(r"([\w-]+) :(\d+)", line))
        assert set(ports) == {"health-1", "health-2", "warmup-1", "warmup-2", "router-1", "batch-1"}, line
        for name, port in [("gateway", gw), *ports.items()]:
            # "ready" is the first request served: a standby or the batch runner may still be
            # starting on a loaded box (its port refused connections once in a full run)
            assert wait_port("127.0.0.1", int(port), 30), (name, proc.tail())
            m = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
            assert m.status_code == 200 and "process_cpu_seconds_total" in m.text, name
        assert "zml_router_requests_total" in httpx.get(f"http://127.0.0.1:{ports['router-1']}/metrics").text
        used += [("127.0.0.1", int(port)) for port in ports.values()]
        # `zml nodes` shows where each simulated node listens.
        table = subprocess.run(_zml("nodes", "--endpoint", f"http://127.0.0.1:{gw}"), capture_output=True,
                               text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "ENDPOINT" in table.stdout
        assert all(ep in table.stdout for ep in endpoints[-1].values())
        used += [("127.0.0.1", gw), ("127.0.0.1", nats_port)]
        used += [endpoint_port(ep) for ep in endpoints[-1].values()]
    free_ports = {endpoint_port(ep)[1] for ep in endpoints[0].values()}
    based_ports = {endpoint_port(ep)[1] for ep in endpoints[1].values()}
    assert not free_ports & based_ports
    assert based_ports == set(range(base, base + len(cfg.nodes)))
    assert endpoints[1]["h100-1"] == f"http://127.0.0.1:{base}"  # in the demo file's order
    _check_secure_by_default(two_ups.secure.proc, two_ups.secure.data, two_ups.secure.nats_port)
    # (stopping both, exit 0 and every port above free again: checked by the fixture's teardown)


def _check_secure_by_default(proc: Proc, data: Path, nats_port: int) -> None:
    """It says how to get a client identity, the seeds are private, the broker refuses
    strangers, and the operator's commands work with the admin identity only."""
    assert any("zml creds issue NAME" in line for line in proc.lines), proc.tail()
    for name in ("gateway", "router", "health", "warmup", "admin"):
        assert (data / "creds" / f"{name}.nk").stat().st_mode & 0o777 == 0o600
    assert _anonymous_refused(f"nats://127.0.0.1:{nats_port}")
    serve = [*_zml("serve", "meta-llama/llama-3-8b-instruct", "--nats-url", f"nats://127.0.0.1:{nats_port}",
                   "--timeout", "60")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    out = subprocess.run(serve, capture_output=True, text=True, timeout=90,
                         env={**env, "ZML_NATS_NKEY": str(data / "creds" / "admin.nk")})
    assert out.returncode == 0, out.stdout + out.stderr  # zml serve: warmup service + KV watch
    issued = subprocess.run(_zml("creds", "issue", "someone", "--data-dir", str(data)), capture_output=True,
                            text=True, timeout=30)
    assert issued.returncode == 0 and "reloaded" in issued.stdout, issued.stdout + issued.stderr
    out = subprocess.run([*serve[:-1], "5"], capture_output=True, text=True, timeout=90,
                         env={**env, "ZML_NATS_NKEY": str(data / "creds" / "someone.nk")})
    # a client identity may not load models: said at once (the server's permissions violation)
    assert out.returncode != 0 and "[AUTH_FAILED]" in out.stderr and '"zml.warmup.serve"' in out.stderr, out.stderr


def _anonymous_refused(url: str) -> bool:
    async def attempt() -> bool:
        try:
            nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
        except nats.errors.Error as exc:
            return "Authorization Violation" in str(exc)
        await nc.close()
        return False

    return asyncio.run(attempt())


def test_zml_up_insecure_is_an_explicit_open_broker(two_ups: TwoUps) -> None:
    """--insecure keeps the old open broker (and says so)."""
    proc, nats_port = two_ups.based.proc, two_ups.based.nats_port
    assert any("no authorization" in line for line in proc.lines), proc.tail()

    async def open_connect() -> bool:
        nc = await nats.connect(f"nats://127.0.0.1:{nats_port}", allow_reconnect=False, connect_timeout=5)
        await nc.close()
        return True

    assert asyncio.run(open_connect())
    # [nats] server_gomaxprocs = "auto" (the demo config): in nats-server's environment only.
    want = f"GOMAXPROCS={nats_gomaxprocs(usable_cores())}".encode()
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    environ = [(Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")[0], Path(f"/proc/{k}/environ").read_bytes())
               for k in kids]
    server = [env for cmd, env in environ if cmd.endswith(b"nats-server")]
    assert len(server) == 1 and want in server[0].split(b"\0"), [cmd for cmd, _ in environ]
    assert all(b"GOMAXPROCS=" not in env for cmd, env in environ if not cmd.endswith(b"nats-server"))
