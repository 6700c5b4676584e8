"""Issue 8 item 2: kill -9 nats-server under load (2 routers, 8 clients) and start it again on the
same port and store. Requests succeed again within 2 s of the broker being back, and every
router's node table is fresh again (its KV watch was re-created with a snapshot), where it used
to stay frozen for 13-16 s and then answer NO_HEALTHY_NODES."""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from conftest import Stack, launch_stack
from loadgen import Load
from zmlcore import subjects
from zmlcore.runtime.launch import Proc, free_port, start_nats

# Kills and restarts processes or the broker: in the chaos suite (`pytest -m chaos`), which CI
# runs after the default one, to keep the default suite within its 10 minutes.
pytestmark = [pytest.mark.slow, pytest.mark.chaos]

async def router_ages(nats_url: str, names: list[str]) -> dict[str, float]:
    """Each router's oldest node state (seconds), from its own admin subject."""
    nc = await nats.connect(servers=nats_url.split(","))
    try:
        out = {}
        for name in names:
            # A router that is reconnecting has no responder for a moment: ~0.3 s usually; once in
            # CI (the 3-server kill under load, a starved 2-core box) more than 3 s. Up to 10 s is
            # waited: what the tests assert is the node states' age, the requests' outcome and
            # that every process stays up, not how fast a router's admin subject comes back.
            for attempt in range(100):
                try:
                    msg = await nc.request(subjects.router_state(name), b"", timeout=5)
                    break
                except nats.errors.NoRespondersError:
                    if attempt == 99:
                        raise
                    await asyncio.sleep(0.1)
            nodes = json.loads(msg.data)["nodes"]
            out[name] = max(n["state_age_s"] for n in nodes.values()) if nodes else float("inf")
        return out
    finally:
        await nc.close()


@pytest.fixture()
def broker_stack(tmp_path: Path) -> Iterator[tuple[Stack, dict[str, Proc], str]]:
    port = free_port()
    store = tempfile.mkdtemp(prefix="zml-restart-nats-", dir=tmp_path)
    nats_proc = {"nats": start_nats("127.0.0.1", port, store)}
    url = f"nats://127.0.0.1:{port}"
    stack = launch_stack(url, tmp_path, routers=2)
    try:
        yield stack, nats_proc, store
    finally:
        stack.stop()
        nats_proc["nats"].stop()


def test_broker_kill_and_restart_under_load(broker_stack: tuple[Stack, dict[str, Proc], str]) -> None:
    stack, nats_proc, store = broker_stack
    port = int(stack.nats_url.rsplit(":", 1)[1])
    load = Load(stack.gateway_url)
    load.start()
    try:
        time.sleep(2.0)
        nats_proc["nats"].popen.kill()  # kill -9
        nats_proc["nats"].popen.wait(10)
        time.sleep(2.0)
        nats_proc["nats"] = start_nats("127.0.0.1", port, store)
        back = time.monotonic()
        time.sleep(2.5)
        ages = asyncio.run(router_ages(stack.nats_url, ["router-1", "router-2"]))
        time.sleep(3.0)
    finally:
        load.stop()
    after = [r for r in load.results if r[0] >= back]
    first_ok = min((r[1] for r in after if r[2]), default=float("inf")) - back
    late = [r for r in after if r[0] >= back + 2.0]
    late_failed = [r[3] for r in late if not r[2]]
    print(f"\nbroker back -> first success {first_ok:.2f} s; requests started >= 2 s after: {len(late)}, "
          f"failed {len(late_failed)}; router state ages 2.5 s after: {ages}")
    assert first_ok < 2.0, f"no success within 2 s of the broker being back ({first_ok:.2f} s)"
    assert late and not late_failed, late_failed[:5]
    # The tables are current again: states at most a few polls (0.5 s each) old, not frozen.
    assert max(ages.values()) < 2.0, ages
    assert all(p.alive() for p in stack.procs.values()), [p.name for p in stack.procs.values() if not p.alive()]


def until_health(url: str, status: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/healthz", timeout=5).status_code != status:
        assert time.monotonic() < deadline, f"the gateway's /healthz never answered {status}"
        time.sleep(0.02)


def test_requests_wait_for_routers_that_reconnect_after_the_gateway(tmp_path: Path) -> None:
    """After a broker restart each client reconnects on its own schedule; a gateway back before
    the routers got the broker's "no responders" and answered 503 NO_HEALTHY_NODES (~0.1 s of
    them in the chaos suite). Made deterministic here: the routers are paused (SIGSTOP) across
    the restart and resumed 0.3 s after the gateway is back. Every request sent once the gateway
    is connected again, or sent again then, must succeed: it waits for a router ([gateway]
    no_router_grace_s)."""
    port = free_port()
    store = tempfile.mkdtemp(prefix="zml-restart-nats-", dir=tmp_path)
    nats_proc = start_nats("127.0.0.1", port, store)
    stack = launch_stack(f"nats://127.0.0.1:{port}", tmp_path, routers=2,
                         extra="[gateway]\nno_router_grace_s = 10\n")  # room for a busy box's reconnects
    routers = [stack.procs["router-1"], stack.procs["router-2"]]
    load = Load(stack.gateway_url, clients=2)
    try:
        load.start()
        time.sleep(1.0)
        for r in routers:
            r.popen.send_signal(signal.SIGSTOP)
        try:
            nats_proc.popen.kill()
            nats_proc.popen.wait(10)
            # The gateway has seen the broker go (a loaded box may take a moment), then comes back
            # to the new one while the routers cannot.
            until_health(stack.gateway_url, 503)
            nats_proc = start_nats("127.0.0.1", port, store)
            until_health(stack.gateway_url, 200)
            back = time.monotonic()
            time.sleep(0.3)
        finally:
            for r in routers:
                r.popen.send_signal(signal.SIGCONT)
        time.sleep(3.0)
    finally:
        load.stop()
        stack.stop()
        nats_proc.stop()
    # Those sent after the gateway was back, and those in flight across the restart: the gateway
    # sends these again once it is back (issue 20 item 3), and they meet the same missing routers.
    after = [r for r in load.results if r[1] >= back]
    failed = [r[3] for r in after if not r[2]]
    waited = max((r[1] - max(r[0], back) for r in after), default=0.0)
    print(f"\n{len(after)} requests ended after the gateway was back, {len(failed)} failed; longest {waited:.2f} s")
    assert after and not failed, failed[:5]
    assert waited >= 0.15  # some waited for the routers (a served request takes ~0.05 s): the case happened


def test_a_request_sent_while_the_broker_is_down_waits_for_it(tmp_path: Path) -> None:
    """A request that reaches the gateway while it has no broker connection was published to
    nobody: it waits for the reconnect within [gateway] broker_grace_s and is then served
    (it used to get 503 CONNECTION_FAILED at once). An outage longer than the grace still ends
    in that clean 503, after the grace."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import MODEL

    port = free_port()
    store = tempfile.mkdtemp(prefix="zml-restart-nats-", dir=tmp_path)
    nats_proc = start_nats("127.0.0.1", port, store)
    stack = launch_stack(f"nats://127.0.0.1:{port}", tmp_path, routers=1,
                         extra="[gateway]\nbroker_grace_s = 3\n")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def post() -> tuple[int, dict, float]:
        t0 = time.monotonic()
        r = httpx.post(stack.gateway_url + "/v1/chat/completions", json=body, timeout=30)
        return r.status_code, r.json(), time.monotonic() - t0

    try:
        until_health(stack.gateway_url, 200)
        assert post()[0] == 200
        nats_proc.popen.kill()
        nats_proc.popen.wait(10)
        until_health(stack.gateway_url, 503)  # the gateway knows its broker is gone
        # Longer than the grace: the clean 503, after waiting it out.
        status, reply, took = post()
        assert status == 503 and reply["error"]["code"] == "CONNECTION_FAILED", reply
        assert took >= 2.8, took
        # Back within the grace: served.
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post)
            time.sleep(0.5)
            nats_proc = start_nats("127.0.0.1", port, store)
            status, reply, took = pending.result(timeout=60)
        assert status == 200 and reply["choices"], reply
        assert took >= 0.4, took  # it did wait for the broker
    finally:
        stack.stop()
        nats_proc.stop()
