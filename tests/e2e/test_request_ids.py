"""Issue 9 on a bus with authorization and several replicas: a caller's request id is in flight
at most once across two routers and two gateways, and only the gateway sets a request's cost
label and default policy by header.

Two routers (one queue group) and two gateways, all with their role's identity; the callers are
client identities. Eight requests with one id sent at once land on both routers (NATS picks a
queue member at random): one replica's own check would let one per replica through.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS

from conftest import MODEL, SecureBus, Stack, launch_stack
from zmlcore.runtime.launch import free_port, service_argv, spawn, wait_port
from zmlcore import subjects
from zmlcore.config import NatsConfig
from zmlcore.access.identity import connect_options

FLEET = [("h100-1", "nvidia_h100", [MODEL]), ("a100-1", "nvidia_a100", [MODEL])]
SAME = 8
#: Tokens of a request that runs long enough for the duplicates to arrive (seconds on the sim).
LONG = 3000


@dataclass
class Replicas:
    stack: Stack
    gateways: list[str]


@pytest.fixture(scope="module")
def replicas(secure_bus: SecureBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    for name in ("ids-alice", "ids-bob"):
        secure_bus.issue(name)
    s = launch_stack(secure_bus.url, tmp_path_factory.mktemp("ids-stack"), fleet=FLEET, routers=2,
                     identities=secure_bus.seeds)
    try:
        port = free_port()  # a second gateway replica, same identity (one per role)
        s.procs["gateway-2"] = spawn("gateway-2", service_argv("gateway", s.config_path, s.nats_url, "--port", str(port)),
                                     env=s.env_of("gateway"))
        deadline = time.monotonic() + 30
        while not wait_port("127.0.0.1", port, 0.2):
            assert s.procs["gateway-2"].alive() and time.monotonic() < deadline, s.procs["gateway-2"].tail(30)
        yield Replicas(s, [s.gateway_url, f"http://127.0.0.1:{port}"])
    finally:
        s.stop()


async def _connect(bus: SecureBus, name: str) -> NATS:
    opts = connect_options(NatsConfig(url=bus.url), seed_file=bus.seeds[name])
    return await nats.connect(bus.url, allow_reconnect=False, connect_timeout=5, **opts)


def _chat(max_tokens: int = 4, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       **extra}).encode()


def _code(msg: Any) -> str | None:
    return (msg.headers or {}).get(subjects.H_ERROR_CODE)


async def _routers_busy(stack: Stack, n: int) -> None:
    """Wait until ``n`` requests run on nodes (each router's view counts its own)."""
    deadline = time.monotonic() + 20
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            nodes = (await http.get(stack.gateway_url + "/v1/nodes")).json()["nodes"]
            if sum(row.get("in_flight", 0) for row in nodes) >= n:
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the request never reached a node")


async def test_duplicate_id_over_nats_is_refused_across_routers(replicas: Replicas, secure_bus: SecureBus) -> None:
    alice, bob = await _connect(secure_bus, "ids-alice"), await _connect(secure_bus, "ids-bob")
    try:
        body = _chat(max_tokens=LONG, request_id="twice")  # runs for seconds on the sim
        sent = [asyncio.create_task(alice.request(subjects.INFER, body, timeout=60)) for _ in range(SAME)]
        done, running = await asyncio.wait(sent, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(1.0)  # every refusal is quick: let them all come back
        refused = [t for t in sent if t.done() and _code(t.result()) == "DUPLICATE_REQUEST_ID"]
        assert len(refused) == SAME - 1, [_code(t.result()) if t.done() else "running" for t in sent]
        assert "twice" in json.loads(refused[0].result().data)["error"]["message"]
        (first,) = [t for t in sent if t not in refused]
        assert not first.done()
        # Another owner's same id is its own.
        other = await bob.request(subjects.INFER, _chat(request_id="twice"), timeout=30)
        assert _code(other) is None, other.data
        # The first ends: the id is free again, on either router. (Not by a cancel: a cancelled
        # id stays refused for a while on every replica, zml_router.request.cancels.)
        t0 = time.monotonic()
        assert _code(await asyncio.wait_for(first, 60)) is None
        print(f"first request ran {time.monotonic() - t0:.1f} s after the refusals")
        for _ in range(4):
            again = await alice.request(subjects.INFER, _chat(request_id="twice"), timeout=30)
            assert _code(again) is None, again.data
    finally:
        await alice.close()
        await bob.close()


async def test_duplicate_id_over_http_is_refused_across_gateways(replicas: Replicas) -> None:
    # Three ids at once: with one replica's check only, each id would get through twice as soon
    # as its copies reach both gateways and both routers (7 in 8 runs at least once).
    ids = ["http-a", "http-b", "http-c"]
    async with httpx.AsyncClient(timeout=60) as http:
        sent = {rid: [asyncio.create_task(http.post(replicas.gateways[i % 2] + "/v1/chat/completions",
                                                    json=json.loads(_chat(max_tokens=LONG, request_id=rid))))
                      for i in range(SAME)] for rid in ids}
        everything = [t for ts in sent.values() for t in ts]
        await asyncio.wait(everything, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(1.0)
        for rid, tasks in sent.items():
            refused = [t for t in tasks if t.done() and t.result().status_code == 409]
            assert len(refused) == SAME - 1, (rid, [t.result().status_code if t.done() else "running" for t in tasks])
            assert refused[0].result().json()["error"]["code"] == "DUPLICATE_REQUEST_ID"
        for rid, tasks in sent.items():
            (first,) = [t for t in tasks if not t.done() or t.result().status_code != 409]
            assert (await asyncio.wait_for(first, 60)).status_code == 200
        # Ended: the same id is accepted again through either gateway.
        for gw in replicas.gateways:
            r = await http.post(gw + "/v1/chat/completions", json=json.loads(_chat(request_id=ids[0])))
            assert r.status_code == 200, r.text


async def test_ids_without_a_client_id_never_clash(replicas: Replicas) -> None:
    """Ids the gateway generates skip the shared claim (Zml-Id-Generated) and still all work."""
    body = json.loads(_chat())
    async with httpx.AsyncClient(timeout=60) as http:
        rs = await asyncio.gather(*(http.post(replicas.gateways[i % 2] + "/v1/chat/completions", json=body)
                                    for i in range(10)))
    assert [r.status_code for r in rs] == [200] * 10
    assert len({r.json()["zml"]["request_id"] for r in rs}) == 10


# --- who may set the cost label and default policy ----------------------------------------------

@dataclass(frozen=True)
class Header:
    name: str
    who: str  # identity sending it
    subject: str
    label_sent: str
    label_seen: str | None  # None: the server refuses the publish (permissions)


HEADERS = [
    Header("a client's own Zml-Label on zml.infer is dropped", "ids-alice", subjects.INFER, "victim-team", ""),
    Header("a client cannot publish on the front-door subject", "ids-alice", subjects.FRONT_DOOR_INFER,
           "victim-team", None),
    Header("the gateway's Zml-Label on the front-door subject is honoured", "gateway", subjects.FRONT_DOOR_INFER,
           "team-a", "team-a"),
    Header("the gateway identity has no business on zml.infer", "gateway", subjects.INFER, "team-a", None),
]


@pytest.mark.parametrize("case", HEADERS, ids=[h.name for h in HEADERS])
async def test_who_sets_the_cost_label(replicas: Replicas, secure_bus: SecureBus, case: Header) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    opts = connect_options(NatsConfig(url=secure_bus.url), seed_file=secure_bus.seeds[case.who])
    nc = await nats.connect(secure_bus.url, allow_reconnect=False, connect_timeout=5, error_cb=on_error, **opts)
    try:
        headers = {subjects.H_LABEL: case.label_sent, subjects.H_DEFAULT_POLICY: "round_robin"}
        if case.label_seen is None:
            # The server refuses the publish itself: once it says so, no reply can come, so the
            # request is not waited out (it was 3 s of silence per case).
            request = asyncio.ensure_future(nc.request(case.subject, _chat(), timeout=10, headers=headers))
            deadline = time.monotonic() + 10
            while not any("permissions violation" in e.lower() and case.subject in e for e in errors):
                assert time.monotonic() < deadline, errors
                await asyncio.sleep(0.02)
            if request.done():  # a reply, or no responders: both refusals, never a served request
                with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                    request.result()
            request.cancel()
            return
        reply = await nc.request(case.subject, _chat(), timeout=30, headers=headers)
        assert _code(reply) is None, reply.data
        zml = json.loads(reply.data)["zml"]
        assert zml.get("label", "") == case.label_seen
        assert (zml["policy"] == "round_robin") == bool(case.label_seen)  # the default policy goes with it
    finally:
        await nc.close()
