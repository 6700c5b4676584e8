"""Router behaviour on a fleet of its own (own broker): failover, cooldown, saturation,
the JetStream queue, cancellation, replicas sharing in-flight counts, a replica dying."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import nats
import pytest

from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects

FLEET = [
    ("h100-a", "nvidia_h100", [MODEL]),
    ("h100-b", "nvidia_h100", [MODEL]),
    ("mi300x-a", "amd_mi300x", [MODEL]),
]
POLICIES = """
[policies.h100-first]
accelerator_chain = ["H100", "MI300X"]
latency_target_ms = 500
cost_priority = "latency"

[policies.queued]
accelerator_chain = ["H100", "MI300X"]
queue_on_saturation = true
max_queue_ms = 6000

[policies.queued-long]
accelerator_chain = ["H100", "MI300X"]
queue_on_saturation = true
max_queue_ms = 20000

[policies.queued-short]
accelerator_chain = ["H100", "MI300X"]
queue_on_saturation = true
max_queue_ms = 700
"""
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("rb"), fleet=FLEET, routers=2, extra=POLICIES,
                     router="cooldown_s = 30\nsaturated_s = 1\n", poll_s=0.3)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture()
def http(stack: Stack) -> Iterator[httpx.Client]:
    stack.clear_faults()
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as c:
        yield c
    stack.clear_faults()


def chat(http: httpx.Client, **extra: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3, **extra})


async def router_states(stack: Stack) -> dict[str, dict]:
    nc = await nats.connect(stack.nats_url)
    try:
        out = {}
        for name in [n for n in stack.procs if n.startswith("router") and stack.procs[n].alive()]:
            msg = await nc.request(subjects.router_state(name), b"", timeout=5)
            out[name] = json.loads(msg.data)
        return out
    finally:
        await nc.close()


def wait_calm(stack: Stack, timeout: float = 10.0) -> None:
    """Until no replica holds a node in cooldown or saturated (the marks earlier requests left
    lapse with time): waited for, not slept, so a test takes what the marks last."""
    deadline = time.monotonic() + timeout
    while True:
        states = asyncio.run(router_states(stack))
        if all(n["cooldown_s"] == 0 and n["saturated_s"] == 0 for s in states.values() for n in s["nodes"].values()):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def test_server_error_fails_over_and_cools_the_node_down(stack: Stack, http: httpx.Client) -> None:
    stack.faults("h100-a", error_rate=1.0, error_status=500, retry_after_s=1.5)
    infos = []
    for _ in range(12):
        r = chat(http, policy="round_robin")
        assert r.status_code == 200, r.text
        infos.append(r.json()["zml"])
    assert all(i["node_id"] != "h100-a" for i in infos)
    assert any(i["attempts"] > 1 for i in infos)  # re-dispatched invisibly
    states = asyncio.run(router_states(stack))
    cooled = [s["nodes"]["h100-a"]["cooldown_s"] for s in states.values()]
    assert max(cooled) > 0  # Retry-After (2 s: HTTP rounds to whole seconds), not the 30 s default
    assert max(cooled) <= 2.0
    stack.clear_faults()
    wait_calm(stack)  # for the next tests


def test_client_error_does_not_trip_cooldown(stack: Stack, http: httpx.Client) -> None:
    stack.faults("h100-b", error_rate=1.0, error_status=400)
    codes = Counter()
    for _ in range(9):
        r = chat(http, policy="round_robin")
        codes[r.status_code] += 1
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "BAD_REQUEST"
    assert codes[400] >= 1  # the node's 400 is the request's fault: relayed, not retried
    states = asyncio.run(router_states(stack))
    assert all(s["nodes"]["h100-b"]["cooldown_s"] == 0 for s in states.values())


def test_overload_marks_the_node_saturated_briefly(stack: Stack, http: httpx.Client) -> None:
    stack.faults("h100-a", overload=True, retry_after_s=1)
    t0 = time.monotonic()
    pinned = chat(http, accelerator_id="h100-a")  # a pinned request cannot move: QUEUE_FULL
    assert pinned.status_code == 503 and pinned.json()["error"]["code"] == "QUEUE_FULL", pinned.text
    for _ in range(6):
        r = chat(http, policy="round_robin")
        assert r.status_code == 200, r.text
    states = asyncio.run(router_states(stack))
    sat = [s["nodes"]["h100-a"] for s in states.values()]
    assert any(n["saturated_s"] > 0 for n in sat) and all(n["cooldown_s"] == 0 for n in sat), (states, time.monotonic() - t0)
    stack.faults("h100-a", overload=False)
    wait_calm(stack, timeout=5)  # its Retry-After (1 s), far short of the 30 s failure cooldown
    served = {chat(http, policy="round_robin").json()["zml"]["node_id"] for _ in range(9)}
    assert "h100-a" in served  # back after its Retry-After, unlike a 30 s failure cooldown


def test_failed_family_falls_back_to_the_next_in_the_chain(stack: Stack, http: httpx.Client) -> None:
    for node in ("h100-a", "h100-b"):
        stack.faults(node, error_rate=1.0, error_status=502, retry_after_s=1)
    r = chat(http, policy="h100-first")
    assert r.status_code == 200, r.text
    assert r.json()["zml"]["node_id"] == "mi300x-a" and r.json()["zml"]["family"] == "MI300X"
    stack.clear_faults()
    wait_calm(stack)  # the 1 s cooldowns lapse, for the next tests


def test_stream_failure_before_first_token_is_invisible(stack: Stack, http: httpx.Client) -> None:
    stack.faults("h100-a", error_rate=1.0, retry_after_s=1)
    for _ in range(4):
        with http.stream("POST", "/v1/chat/completions",
                         json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True,
                               "policy": "round_robin"}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert r.headers["x-zml-node-id"] != "h100-a"
    stack.clear_faults()
    wait_calm(stack)


def test_stream_broken_after_first_token_ends_with_an_error_event(stack: Stack, http: httpx.Client) -> None:
    for node in stack.node_ids:
        stack.faults(node, drop_mid_stream=1.0)
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": MODEL, "messages": CHAT, "max_tokens": 50, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in lines
    err = json.loads(lines[-1][len("data: "):])["error"]
    assert err["code"] == "BACKEND_ERROR" and err["message"]


def test_saturation_fails_fast_with_queue_full_and_routing_context(stack: Stack, http: httpx.Client) -> None:
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=1)
    r = chat(http)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "QUEUE_FULL"
    assert err["routing_context"]["recommendation"]
    assert r.headers.get("retry-after")
    stack.clear_faults()  # an overloaded node's polled state keeps renewing its saturation mark
    wait_calm(stack)


def test_queue_on_saturation_waits_then_dispatches(stack: Stack, http: httpx.Client) -> None:
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=0.5)

    async def scenario() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
            t0 = time.monotonic()
            tasks = [asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "max_tokens": 2, "policy": "queued", "request_id": f"q{i}"}))
                for i in range(4)]
            await asyncio.sleep(1.5)
            early = [t.result().text if not t.exception() else repr(t.exception()) for t in tasks if t.done()]
            assert not early, early  # they wait in JetStream, not fail
            for node in stack.node_ids:
                stack.faults(node, overload=False)
            return list(await asyncio.gather(*tasks)), time.monotonic() - t0

    responses, elapsed = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert elapsed >= 1.5


def test_queued_request_expires_with_queue_full(stack: Stack, http: httpx.Client) -> None:
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=0.3)
    t0 = time.monotonic()
    r = chat(http, policy="queued-short")
    waited = time.monotonic() - t0
    assert r.status_code == 503 and r.json()["error"]["code"] == "QUEUE_FULL", r.text
    assert r.json()["error"]["routing_context"]["final_error"] == "queue_timeout"
    assert 0.6 <= waited < 5


def test_http_disconnect_cancels_on_the_node(stack: Stack) -> None:
    stack.clear_faults()
    time.sleep(1.0)  # saturation marks from earlier tests lapse

    def running() -> int:
        return sum(stack.sim_state(n)["batch"]["running"] + stack.sim_state(n)["queue"]["waiting"] for n in stack.node_ids)

    assert running() == 0
    with httpx.Client(base_url=stack.gateway_url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "max_tokens": 8_000, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it closes the response
            next(lines)
            deadline = time.monotonic() + 3
            while running() != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert running() == 1
    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0


async def test_nats_cancel_message_aborts_the_backend_call(stack: Stack) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 8_000, "request_id": "cancel-me"}
        fut = asyncio.ensure_future(nc.request(subjects.INFER, json.dumps(body).encode(), timeout=20))
        await asyncio.sleep(0.5)
        assert sum(stack.sim_state(n)["batch"]["running"] for n in stack.node_ids) == 1
        await nc.publish(subjects.cancel("cancel-me"), b"")
        reply = await fut
        assert reply.headers[subjects.H_ERROR_CODE] == "CANCELLED"
        await asyncio.sleep(0.3)
        assert sum(stack.sim_state(n)["batch"]["running"] for n in stack.node_ids) == 0
    finally:
        await nc.close()


async def test_replicas_share_in_flight_counts(stack: Stack) -> None:
    stack.clear_faults()
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 3000, "policy": "round_robin"})) for _ in range(12)]
        await asyncio.sleep(1.0)
        states = await router_states(stack)
        assert len(states) == 2
        served = {name: s["in_flight"] for name, s in states.items()}
        assert all(served.values()), served  # both replicas hold some of the burst
        # Each replica counts the other's dispatches too: their views agree, and add up to 12.
        views = [{n: v["outstanding"] for n, v in s["nodes"].items()} for s in states.values()]
        assert views[0] == views[1], views
        assert sum(views[0].values()) == 12
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_KILLED: list = []


def _kill(stack: Stack, name: str) -> None:
    import signal

    proc = stack.procs.pop(name)
    _KILLED.append(proc)
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(10)


async def test_killing_one_of_two_routers_under_load_loses_nothing(stack: Stack) -> None:
    stack.clear_faults()
    timeout_ms = 3000
    results: list[tuple[int, str, float, bool]] = []

    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
        async def one(after_kill: bool) -> None:
            t0 = time.monotonic()
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": CHAT, "max_tokens": 400, "timeout_ms": timeout_ms})
            code = r.json()["error"]["code"] if r.status_code != 200 else "OK"
            results.append((r.status_code, code, time.monotonic() - t0, after_kill))

        tasks = [asyncio.create_task(one(False)) for _ in range(40)]
        await asyncio.sleep(0.15)
        _kill(stack, "router-2")
        await asyncio.sleep(0.5)
        tasks += [asyncio.create_task(one(True)) for _ in range(20)]
        await asyncio.gather(*tasks)
    stack.start_router("router-2")
    assert len(results) == 60
    codes = Counter(code for _, code, _, _ in results)
    # What the dead replica held ends in a retryable error; nothing else is lost.
    assert set(codes) <= {"OK", "TIMEOUT", "BACKEND_ERROR", "NO_HEALTHY_NODES"}, codes
    assert all(code == "OK" for _, code, _, after in results if after), codes
    assert codes["OK"] >= 30, codes
    assert max(elapsed for _, _, elapsed, _ in results) < timeout_ms / 1000 + 2.5  # none hangs
    # The survivor forgets the dead replica's in-flight share within its TTL.
    await asyncio.sleep(3.5)
    # router_states asks every live replica: the restarted one must be listening (slow on a busy box).
    assert await asyncio.to_thread(stack.procs["router-2"].wait_for, "started", 30), stack.procs["router-2"].tail()
    states = await router_states(stack)
    assert sum(v["outstanding"] for v in states["router-1"]["nodes"].values()) == 0


async def test_queued_request_survives_a_router_restart(stack: Stack) -> None:
    await asyncio.sleep(1.0)  # router-2 restarted by the previous test
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=0.3)
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "policy": "queued-long", "timeout_ms": 25000}
        await nc.publish(subjects.INFER, json.dumps(body).encode(), reply=inbox)
        await asyncio.sleep(0.8)
        for name in [n for n in list(stack.procs) if n.startswith("router")]:
            _kill(stack, name)  # every router dies while the request waits in JetStream
        stack.start_router("router-1")
        stack.start_router("router-2")
        await asyncio.sleep(1.0)
        stack.clear_faults()
        try:
            msg = await sub.next_msg(timeout=15)
        except Exception:
            for p in [*_KILLED, *stack.procs.values()]:
                print(p.name, p.tail(15))
            raise
        assert subjects.H_ERROR_CODE not in (msg.headers or {}), msg.data
        assert json.loads(msg.data)["choices"][0]["message"]["content"]
    finally:
        stack.clear_faults()
        await nc.close()


async def test_run_time_price_change_moves_cost_routed_traffic(stack: Stack) -> None:
    import subprocess
    import sys

    stack.clear_faults()
    # Earlier tests kill and restart routers: wait until every replica sees an idle fleet.
    deadline = time.monotonic() + 10
    while True:
        states = await router_states(stack)
        calm = len(states) == 2 and all(
            n["effective_outstanding"] == 0 and n["cooldown_s"] == 0 and n["saturated_s"] == 0
            and n["status"] == "up" for s in states.values() for n in s["nodes"].values())
        if calm or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    nc = await nats.connect(stack.nats_url)

    async def cost_picks() -> Counter:
        picks: Counter = Counter()
        for _ in range(6):
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "policy": "cost"}
            msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
            picks[json.loads(msg.data)["zml"]["node_id"]] += 1
        return picks

    try:
        before = await cost_picks()
        # Make a node the cost policy did not pick the cheapest by far (measured speeds move the
        # list-price order a little on time-scaled sims, so pick the target from what happened).
        target = next(n for n in ("h100-b", "h100-a", "mi300x-a") if n not in before)
        list_price = {"h100-a": 4.0, "h100-b": 4.0, "mi300x-a": 3.0}[target]
        cli = [sys.executable, "-m", "zml.cli", "cost", "set", target, "0.01", "--source", "spot:test",
               "--nats-url", stack.nats_url]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        await asyncio.sleep(0.5)
        states = await router_states(stack)
        assert all(s["nodes"][target]["cost_per_hour"] == 0.01 for s in states.values())
        after = await cost_picks()
        assert set(after) == {target}, (before, after)
        with httpx.Client(timeout=10) as client:
            nodes = {n["node_id"]: n for n in client.get(stack.gateway_url + "/v1/nodes").json()["nodes"]}
        assert nodes[target]["cost_per_hour"] == 0.01 and nodes[target]["routers"] == 2
        clear = [sys.executable, "-m", "zml.cli", "cost", "clear", target, "--nats-url", stack.nats_url]
        assert subprocess.run(clear, capture_output=True, text=True, timeout=30).returncode == 0
        await asyncio.sleep(0.5)
        states = await router_states(stack)
        assert all(s["nodes"][target]["cost_per_hour"] == list_price for s in states.values())
    finally:
        await nc.close()


async def test_queued_requests_leave_in_arrival_order(stack: Stack) -> None:
    stack.clear_faults()
    r = httpx.post(stack.sim_url("h100-a") + "/sim/profile", json={"max_concurrency": 1, "max_waiting": 0}, timeout=5)
    assert r.status_code == 200, r.text
    try:
        order: list[int] = []
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
            async def one(i: int) -> None:
                r = await client.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": CHAT, "max_tokens": 60, "policy": "queued-long",
                    "accelerator_id": "h100-a"})
                assert r.status_code == 200, r.text
                order.append(i)

            tasks = []
            for i in range(5):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.08)
            await asyncio.gather(*tasks)
        assert order == sorted(order), order  # one slot: completion order is dispatch order
    finally:
        httpx.post(stack.sim_url("h100-a") + "/sim/profile", json={"max_concurrency": 32, "max_waiting": None}, timeout=5)


async def test_cancel_drops_a_queued_request(stack: Stack) -> None:
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=2)

    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "policy": "queued-long", "request_id": "q-cancel"}
        await nc.publish(subjects.INFER, json.dumps(body).encode(), reply=inbox)
        await asyncio.sleep(0.5)
        before = stack.decisions()  # (the sims' counters would also count health's calibrations)
        await nc.publish(subjects.cancel("q-cancel"), b"")
        await asyncio.sleep(0.3)
        stack.clear_faults()
        await asyncio.sleep(2.5)
        assert stack.decisions() == before  # never sent to a node again
        while True:  # at most a CANCELLED answer, never a completion
            try:
                msg = await sub.next_msg(timeout=0.2)
            except Exception:
                break
            assert (msg.headers or {}).get(subjects.H_ERROR_CODE) == "CANCELLED", msg.data
    finally:
        stack.clear_faults()
        await nc.close()


async def test_a_queued_request_keeps_its_id(stack: Stack) -> None:
    """Issue 9: while a request waits in the saturation queue (held by no router's own table), the
    same owner's id is still refused on every replica; once it is answered the id is free.
    Duplicates keep coming for 2.5 s, while the queued request is tried on the (refusing) nodes
    every ~second: a duplicate waiting for the bucket's verdict on its id once stood in its
    router's in-flight table, where the queued request coming out of the queue met it and
    answered DUPLICATE_REQUEST_ID to its own requester (3 runs in 8 with 40 duplicates)."""
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=0.5)
    nc = await nats.connect(stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "policy": "queued-long", "request_id": "q-keeps"}
        await nc.publish(subjects.INFER, json.dumps(body).encode(), reply=inbox)
        await asyncio.sleep(1.0)  # queued by now (every node refuses)
        sent, until = 0, time.monotonic() + 2.5
        while sent < 4 or time.monotonic() < until:  # whichever router each copy reaches
            dup = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
            assert (dup.headers or {}).get(subjects.H_ERROR_CODE) == "DUPLICATE_REQUEST_ID", dup.data
            sent += 1
        stack.clear_faults()
        first = await sub.next_msg(timeout=20)
        assert subjects.H_ERROR_CODE not in (first.headers or {}), first.data
        again = await nc.request(subjects.INFER, json.dumps({**body, "policy": "h100-first"}).encode(), timeout=20)
        assert subjects.H_ERROR_CODE not in (again.headers or {}), again.data
    finally:
        stack.clear_faults()
        await nc.close()
