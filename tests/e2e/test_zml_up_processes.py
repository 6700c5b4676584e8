"""`zml up --gateways 2`: two gateway processes on one port (SO_REUSEPORT), each listening on a
socket of its own; one killed with -9 is restarted while the other keeps answering; SIGTERM
stops every child by PID."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import FLEET, MODEL, fleet_toml
from zmlcore.runtime.launch import free_port, port_in_use, spawn

# Kills and restarts processes or the broker: in the chaos suite (`pytest -m chaos`), which CI
# runs after the default one, to keep the default suite within its 10 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.chaos]

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _children(pid: int) -> dict[int, list[str]]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return {}
    out = {}
    for kid in kids:
        try:
            out[int(kid)] = [a.decode() for a in Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
    return out


def _gateways(pid: int) -> list[int]:
    return sorted(k for k, argv in _children(pid).items() if "zml_gateway" in argv)


def _listeners(port: int) -> set[str]:
    """Inodes of the sockets listening on ``port`` (IPv4)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "0A":
            out.add(f[9])
    return out


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def _wait(cond, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _fresh_connection_requests(url: str, n: int) -> list[int]:
    codes = []
    for _ in range(n):
        with httpx.Client(timeout=30) as c:  # a new connection each: the kernel picks a listener
            codes.append(c.post(url + "/v1/chat/completions", json=BODY).status_code)
    return codes


def test_two_gateways_share_the_port_and_are_restarted(tmp_path: Path) -> None:
    config = tmp_path / "zml.toml"
    config.write_text(fleet_toml({node_id: free_port() for node_id, _, _ in FLEET}))
    port = free_port()
    up = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--config", str(config), "--gateway-port", str(port),
                          "--insecure", "--gateways", "2", "--routers", "1", "--standby", "0", "--metrics-port", "0"])
    children: list[int] = []
    try:
        assert up.wait_for("zml ready", 120), up.tail(40)
        assert "gateway processes 2, routers 1" in next(line for line in up.lines if "zml ready" in line)
        children = list(_children(up.pid))
        url = f"http://127.0.0.1:{port}"
        first = _wait(lambda: (g := _gateways(up.pid)) and len(g) == 2 and g, 30, "two gateway processes")
        # Each gateway holds a listening socket of its own on the one port.
        listeners = _listeners(port)
        owned = [_socket_inodes(pid) & listeners for pid in first]
        assert all(len(o) == 1 for o in owned) and owned[0] != owned[1], (listeners, owned)
        assert _fresh_connection_requests(url, 10) == [200] * 10
        # kill -9 one: the other keeps answering, and the supervisor starts a new one on the port.
        os.kill(first[0], signal.SIGKILL)
        assert _fresh_connection_requests(url, 10) == [200] * 10
        again = _wait(lambda: (g := _gateways(up.pid)) and len(g) == 2 and first[0] not in g and g, 60, "a restarted gateway")
        new = next(pid for pid in again if pid not in first)
        _wait(lambda: _socket_inodes(new) & _listeners(port), 60, "the restarted gateway listening")
        assert _fresh_connection_requests(url, 10) == [200] * 10
        children = list(_children(up.pid))
    finally:
        up.popen.send_signal(signal.SIGTERM)
        up.popen.wait(60)
    assert up.popen.returncode == 0
    for pid in children:  # every child stopped by `zml up` itself
        assert not _alive(pid), pid


def test_a_second_ctrl_c_kills_every_process(tmp_path: Path) -> None:
    """Ctrl-C twice: the first starts the graceful stop, the second kills every process at once
    (what a user does when a drain takes too long). Nothing is left behind either way. The
    terminal signals its whole foreground group; so does this test, to the group `zml up` leads."""
    ports = {node_id: free_port() for node_id, _, _ in FLEET}
    config = tmp_path / "zml.toml"
    config.write_text(fleet_toml(ports))
    port, nats_port = free_port(), free_port()
    up = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--config", str(config), "--gateway-port", str(port),
                          "--nats-port", str(nats_port), "--insecure", "--routers", "1", "--standby", "0",
                          "--metrics-port", "0"], new_session=True)
    children: list[int] = []
    try:
        assert up.wait_for("zml ready", 120), up.tail(40)
        children = list(_children(up.pid))
        assert len(children) >= 5, children  # nats, health, warmup, router, gateway, the sims
        os.killpg(up.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(up.pid, signal.SIGINT)
        up.popen.wait(15)
        assert any("interrupted again" in line for line in up.lines), up.tail(40)
    finally:
        if up.popen.poll() is None:
            up.popen.kill()
            up.popen.wait(10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]
    assert not [p for p in (port, nats_port, *ports.values()) if port_in_use("127.0.0.1", p)]


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False
