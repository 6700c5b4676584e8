"""`zml up` as a user runs it: one command, a ready line, a working request, a clean stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from zmlcore.launch import free_port, port_in_use, spawn
from zml.cli.up import demo_config_path
from zmlcore.config import load_config
from zmlcore.launch import endpoint_port


def _zml(*args: str) -> list[str]:
    return [sys.executable, "-m", "zml.cli", *args]


@pytest.mark.timeout(120)
def test_zml_up_runs_the_demo_fleet_and_stops_everything() -> None:
    cfg = load_config(demo_config_path())
    sim_ports = [endpoint_port(n.endpoint) for n in cfg.nodes]
    if any(port_in_use(h, p) for h, p in sim_ports):
        pytest.skip("a demo fleet port (91xx) is taken on this machine")
    gw, nats_port = free_port(), free_port()
    proc = spawn("zml-up", _zml("up", "--gateway-port", str(gw), "--nats-port", str(nats_port)))
    try:
        assert proc.wait_for("zml ready", 90), proc.tail()
        ready = next(line for line in proc.lines if "zml ready" in line)
        assert f"http://127.0.0.1:{gw}" in ready
        r = httpx.post(f"http://127.0.0.1:{gw}/v1/chat/completions", timeout=30,
                       json={"model": "meta-llama/llama-3-8b-instruct",
                             "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["zml"]["node_id"] in {n.id for n in cfg.nodes}
        nodes = httpx.get(f"http://127.0.0.1:{gw}/v1/nodes", timeout=10).json()["nodes"]
        assert {n["accelerator_type"] for n in nodes} >= {"nvidia_h100", "nvidia_a100", "amd_mi300x", "intel_gaudi2"}
    finally:
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0, proc.tail()
    # Every child is gone: the ports it used are free again.
    deadline = time.monotonic() + 10
    used = [("127.0.0.1", gw), ("127.0.0.1", nats_port), *sim_ports]
    while time.monotonic() < deadline and any(port_in_use(h, p) for h, p in used):
        time.sleep(0.2)
    assert not [p for h, p in used if port_in_use(h, p)]


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
