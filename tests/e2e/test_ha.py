"""Issue 8 item 8, single points of failure, through `zml up` (two health and two warmup
replicas by default, one active through a leader lease):

- kill -9 the active health (then the active warmup): the standby takes over within two poll
  (sweep) intervals, the routers' node state never goes stale, requests keep succeeding.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator

import nats
import pytest

from conftest import FLEET, fleet_toml
from loadgen import Load
from test_broker_restart import router_ages
from zmlcore import subjects
from zmlcore.runtime.launch import Proc, free_port, spawn

# Kills and restarts processes or the broker: in the chaos suite (`pytest -m chaos`), which CI
# runs after the default one, to keep the default suite within its 10 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.chaos]

POLL_S = 2.0  # health poll and warmup sweep interval: the lease TTL follows them
STALE_S = 12.0  # the routers' [router] stale_after_s


async def _holder(nats_url: str, role: str) -> str:
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(subjects.LEASES_BUCKET)
        entry = await kv.get(role)
        return (entry.value or b"").decode()
    except Exception:
        return ""
    finally:
        await nc.close()


def holder(nats_url: str, role: str) -> str:
    return asyncio.run(_holder(nats_url, role))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str, str]]:
    tmp = tmp_path_factory.mktemp("ha")
    ports = {node_id: free_port() for node_id, _, _ in FLEET}
    config = tmp / "zml.toml"
    config.write_text(fleet_toml(ports, poll_s=POLL_S, router=f"cooldown_s = 2\nstale_after_s = {STALE_S}\n",
                                 extra=f"[warmup]\nsweep_interval_s = {POLL_S}\n"))
    gw, nats_port = free_port(), free_port()
    proc = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--config", str(config), "--routers", "2",
                            "--gateway-port", str(gw), "--nats-port", str(nats_port), "--insecure"])
    try:
        assert proc.wait_for("zml ready", 120), proc.tail(40)
        yield proc, f"http://127.0.0.1:{gw}", f"nats://127.0.0.1:{nats_port}"
    finally:
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.wait(60)


def _wait_holder(nats_url: str, role: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = holder(nats_url, role)
        if h:
            return h
        time.sleep(0.2)
    raise AssertionError(f"no {role} lease holder")


@pytest.mark.parametrize("role", ["health", "warmup"])
def test_kill_the_active_replica_the_standby_takes_over(up: tuple[Proc, str, str], role: str) -> None:
    proc, url, nats_url = up
    active = _wait_holder(nats_url, role)
    pid = int(active.rsplit(":", 1)[1])
    load = Load(url, clients=8)
    load.start()
    ages: list[float] = []
    try:
        time.sleep(1.5)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        took = None
        while time.monotonic() - killed < 3 * POLL_S + 2:
            h = holder(nats_url, role)
            if took is None and h and h != active:
                took = time.monotonic() - killed
            ages.append(max(asyncio.run(router_ages(nats_url, ["router-1", "router-2"])).values()))
            time.sleep(0.1)
    finally:
        load.stop()
    new = holder(nats_url, role)
    failed = [r[3] for r in load.results if not r[2]]
    print(f"\n{role}: {active} -> {new} in {took} s; max router state age {max(ages):.2f} s; "
          f"{len(load.results)} requests, {len(failed)} failed")
    assert took is not None and new != active, (active, new, proc.tail(20))
    assert took <= 2 * POLL_S, f"took over after {took:.2f} s, more than two intervals"
    # Node state never went stale (what the routers call stale), nor did a request fail.
    assert max(ages) < STALE_S, ages
    assert not failed, failed[:5]
    assert proc.alive()
    # The killed replica was restarted by `zml up` and waits as a standby.
    assert proc.wait_for(f"{role}-", 10)
