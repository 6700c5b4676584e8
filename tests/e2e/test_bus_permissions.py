"""The bus with authorization on, as `zml up` runs it: every attack from issue 9 fails with a
permissions violation, and what each identity needs works.

The stack (sims, health, one router, gateway) runs on a nats-server with one nkey identity per
service (tests/conftest.py ``secure_bus``); the attackers are client identities issued at run
time. Each attack runs on its own connection and must produce the server's "permissions
violation" for the subject it tried, naming the attack in the test id.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NATS

import zml
from conftest import MODEL, SecureBus, Stack, launch_stack
from zmlcore.runtime.launch import service_argv, spawn
from zmlcore import subjects
from zml.cli import _identities
from zmlcore.config import NatsConfig
from zmlcore.fleet.registry import add_node, list_nodes, remove_node
from zmlcore.messages import NodeSpec
from zmlcore.access.identity import connect_options, public_key
from zmlcore.bus.publish import flush

FLEET = [("h100-1", "nvidia_h100", [MODEL]), ("a100-1", "nvidia_a100", [MODEL])]


@pytest.fixture(scope="module")
def stack(secure_bus: SecureBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for name in ("alice", "bob", "mallory"):
        secure_bus.issue(name)
    secure_bus.issue("olive", role="observer")  # a billing system: events and node state only
    s = launch_stack(secure_bus.url, tmp_path_factory.mktemp("secure-stack"), fleet=FLEET, routers=1,
                     identities=secure_bus.seeds)
    s.procs["batch"] = spawn("batch", service_argv("batch", s.config_path, secure_bus.url), env=s.env_of("batch"))
    try:
        yield s
    finally:
        s.stop()


class Conn:
    """One identity's connection that records the server's permission errors."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    async def violation(self, subject: str, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.errors:
                if "permissions violation" in e.lower() and subject.lower() in e.lower():
                    return e
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permissions violation for {subject!r}; errors: {self.errors}")


async def connect_as(bus: SecureBus, name: str) -> Conn:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    opts = connect_options(NatsConfig(url=bus.url), seed_file=bus.seeds[name])
    nc = await nats.connect(bus.url, error_cb=on_error, allow_reconnect=False, connect_timeout=5, **opts)
    return Conn(nc, errors)


async def _noop(msg: Any) -> None:
    return None


def _chat(max_tokens: int = 4, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       **extra}).encode()


@dataclass(frozen=True)
class Attack:
    name: str
    who: str  # identity attempting it
    act: Callable[[Conn, SecureBus], Awaitable[Any]]
    subject: Callable[[SecureBus], str]  # the subject the violation must name


def _sub(subject: str, queue: str = "") -> Callable[[Conn, SecureBus], Awaitable[Any]]:
    async def act(c: Conn, bus: SecureBus) -> None:
        await c.nc.subscribe(subject, queue=queue, cb=_noop)
        await flush(c.nc)
    return act


def _pub(subject: str, data: bytes = b"{}") -> Callable[[Conn, SecureBus], Awaitable[Any]]:
    async def act(c: Conn, bus: SecureBus) -> None:
        await c.nc.publish(subject, data)
        await flush(c.nc)
    return act


def _const(s: str) -> Callable[[SecureBus], str]:
    return lambda bus: s


def _alice_inbox(bus: SecureBus) -> str:
    return f"{subjects.inbox_prefix(public_key(bus.seeds['alice']))}.>"


def _alice_cancel(bus: SecureBus) -> str:
    return subjects.cancel("req-1", public_key(bus.seeds["alice"]))


async def _sub_alice_inbox(c: Conn, bus: SecureBus) -> None:
    await _sub(_alice_inbox(bus))(c, bus)


async def _cancel_alice(c: Conn, bus: SecureBus) -> None:
    await _pub(_alice_cancel(bus), b"")(c, bus)


async def _open_kv(bucket: str, c: Conn) -> None:
    # A refused API request gets no reply: what the attack must meet is the server's violation
    # (Conn.violation waits for it), not the request's 5 s default timeout, 6 times per run.
    try:
        await c.nc.jetstream(timeout=0.5).key_value(bucket)
    except Exception:  # the API request is refused: no reply, or not found
        pass


def _read_kv(bucket: str) -> Callable[[Conn, SecureBus], Awaitable[Any]]:
    async def act(c: Conn, bus: SecureBus) -> None:
        await asyncio.wait_for(_open_kv(bucket, c), 10)
    return act


NODE = msgspec.json.encode({"node": {"id": "evil", "accelerator": "nvidia_h100", "endpoint": "http://127.0.0.1:9",
                                     "models": [MODEL]}})
DELTA = msgspec.json.encode({"router_id": "evil", "node_id": "h100-1", "outstanding": 1000, "pending": 1000, "ts": 0})

ATTACKS = [
    Attack("read every prompt: subscribe zml.infer without a queue group", "mallory", _sub(subjects.INFER),
           _const(subjects.INFER)),
    Attack("steal prompts: subscribe zml.infer in the routers' queue group", "mallory",
           _sub(subjects.INFER, subjects.ROUTER_QUEUE), _const(subjects.INFER)),
    Attack("read every reply: subscribe _INBOX.>", "mallory", _sub("_INBOX.>"), _const("_INBOX.>")),
    Attack("read every reply: subscribe _ZML_INBOX.>", "mallory", _sub(f"{subjects.INBOX_ROOT}.>"),
           _const(f"{subjects.INBOX_ROOT}.>")),
    Attack("read another client's replies: subscribe its inbox", "mallory", _sub_alice_inbox, _alice_inbox),
    Attack("register a node: zml.admin.nodes.add", "mallory", _pub(subjects.admin_nodes("add"), NODE),
           _const(subjects.admin_nodes("add"))),
    Attack("remove a node: zml.admin.nodes.remove", "mallory", _pub(subjects.admin_nodes("remove")),
           _const(subjects.admin_nodes("remove"))),
    Attack("register a node: write to the zml_nodes bucket", "mallory", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    Attack("register a node: write to the zml_registry bucket", "mallory",
           _pub(f"$KV.{subjects.REGISTRY_BUCKET}.evil", NODE), _const(f"$KV.{subjects.REGISTRY_BUCKET}.evil")),
    Attack("change prices: write to the zml_costs bucket", "mallory", _pub(f"$KV.{subjects.COSTS_BUCKET}.h100-1"),
           _const(f"$KV.{subjects.COSTS_BUCKET}.h100-1")),
    Attack("read node state: open the zml_nodes bucket", "mallory", _read_kv(subjects.NODES_BUCKET),
           _const(f"$JS.API.STREAM.INFO.KV_{subjects.NODES_BUCKET}")),
    Attack("read node state: watch zml_nodes updates", "mallory", _sub(f"$KV.{subjects.NODES_BUCKET}.>"),
           _const(f"$KV.{subjects.NODES_BUCKET}.>")),
    Attack("read the registry bucket", "mallory", _read_kv(subjects.REGISTRY_BUCKET),
           _const(f"$JS.API.STREAM.INFO.KV_{subjects.REGISTRY_BUCKET}")),
    Attack("make every node look busy: forge zml.node.inflight deltas", "mallory", _pub(subjects.INFLIGHT, DELTA),
           _const(subjects.INFLIGHT)),
    Attack("cool down every node: forge zml.node.marks", "mallory", _pub(subjects.NODE_MARKS),
           _const(subjects.NODE_MARKS)),
    Attack("double-dispatch queued requests: write zml_queue_claims", "mallory",
           _pub(f"$KV.{subjects.QUEUE_CLAIMS_BUCKET}.1"), _const(f"$KV.{subjects.QUEUE_CLAIMS_BUCKET}.1")),
    Attack("block another's request ids, or free a claimed one: write zml_request_ids", "mallory",
           _pub(f"$KV.{subjects.REQUEST_IDS_BUCKET}.x"), _const(f"$KV.{subjects.REQUEST_IDS_BUCKET}.x")),
    Attack("read request ids in flight: open the zml_request_ids bucket", "mallory",
           _read_kv(subjects.REQUEST_IDS_BUCKET), _const(f"$JS.API.STREAM.INFO.KV_{subjects.REQUEST_IDS_BUCKET}")),
    Attack("attribute cost to another label: publish on the gateway's zml.gateway.infer", "mallory",
           _pub(subjects.FRONT_DOOR_INFER, _chat()), _const(subjects.FRONT_DOOR_INFER)),
    Attack("mint an API key: write the zml_keys bucket", "mallory", _pub(f"$KV.{subjects.KEYS_BUCKET}.evil"),
           _const(f"$KV.{subjects.KEYS_BUCKET}.evil")),
    Attack("read API key hashes: open the zml_keys bucket", "mallory", _read_kv(subjects.KEYS_BUCKET),
           _const(f"$JS.API.STREAM.INFO.KV_{subjects.KEYS_BUCKET}")),
    Attack("reset a plan's usage: write the zml_limits bucket", "mallory", _pub(f"$KV.{subjects.LIMITS_BUCKET}.x"),
           _const(f"$KV.{subjects.LIMITS_BUCKET}.x")),
    Attack("gateway mints an API key", "gateway", _pub(f"$KV.{subjects.KEYS_BUCKET}.evil"),
           _const(f"$KV.{subjects.KEYS_BUCKET}.evil")),
    Attack("forge in-flight snapshots", "mallory", _pub(subjects.INFLIGHT_SNAPSHOT), _const(subjects.INFLIGHT_SNAPSHOT)),
    Attack("read node load: subscribe zml.node.inflight", "mallory", _sub(subjects.INFLIGHT), _const(subjects.INFLIGHT)),
    Attack("cancel someone else's request: zml.cancel.<their owner>.<id>", "mallory", _cancel_alice, _alice_cancel),
    Attack("cancel anyone's request: zml.cancel.<id>", "mallory", _pub(subjects.cancel("req-1"), b""),
           _const(subjects.cancel("req-1"))),
    Attack("watch every cancel: subscribe zml.cancel.>", "mallory", _sub(f"{subjects.CANCEL_PREFIX}.>"),
           _const(f"{subjects.CANCEL_PREFIX}.>")),
    Attack("push every request into the saturation queue: zml.queue_busy", "mallory",
           _pub(subjects.QUEUE_BUSY, f"{MODEL} 9999999999".encode()), _const(subjects.QUEUE_BUSY)),
    Attack("inject queue entries: publish zml.queue.<model>", "mallory", _pub(subjects.queue("m"), _chat()),
           _const(subjects.queue("m"))),
    Attack("read the queue stream: create a consumer on ZML_QUEUE", "mallory",
           _pub(f"$JS.API.CONSUMER.CREATE.{subjects.QUEUE_STREAM}"),
           _const(f"$JS.API.CONSUMER.CREATE.{subjects.QUEUE_STREAM}")),
    Attack("delete the queue stream", "mallory", _pub(f"$JS.API.STREAM.DELETE.{subjects.QUEUE_STREAM}"),
           _const(f"$JS.API.STREAM.DELETE.{subjects.QUEUE_STREAM}")),
    Attack("read completion events (request ids, nodes)", "mallory", _sub(f"{subjects.EVENTS_PREFIX}.>"),
           _const(f"{subjects.EVENTS_PREFIX}.>")),
    Attack("forge completion events (fake node errors)", "mallory", _pub(subjects.event(subjects.EVENT_COMPLETED)),
           _const(subjects.event(subjects.EVENT_COMPLETED))),
    Attack("load models on demand: zml.warmup.serve", "mallory", _pub(subjects.WARMUP_SERVE),
           _const(subjects.WARMUP_SERVE)),
    Attack("read (or force) the placement plan: zml.warmup.plan", "mallory", _pub(subjects.WARMUP_PLAN),
           _const(subjects.WARMUP_PLAN)),
    Attack("forge placement events", "mallory", _pub(subjects.event(subjects.EVENT_PLACEMENT)),
           _const(subjects.event(subjects.EVENT_PLACEMENT))),
    Attack("read the routers' fleet view: zml.admin.routers.state", "mallory", _pub(subjects.ROUTERS_STATE),
           _const(subjects.ROUTERS_STATE)),
    Attack("read routing decisions (request ids, nodes, beliefs): zml.admin.routers.decision", "mallory",
           _pub(subjects.ROUTERS_DECISION, b'{"decision_id":"00"}'), _const(subjects.ROUTERS_DECISION)),
    Attack("answer inference requests as a router", "mallory", _pub(f"{subjects.INBOX_ROOT}.x.y"),
           _const(f"{subjects.INBOX_ROOT}.x.y")),
    # A compromised service can do no more than its job.
    Attack("gateway registers a node", "gateway", _pub(subjects.admin_nodes("add"), NODE),
           _const(subjects.admin_nodes("add"))),
    Attack("gateway reads prompts", "gateway", _sub(subjects.INFER), _const(subjects.INFER)),
    Attack("gateway writes node state", "gateway", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    Attack("router writes node state", "router", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    Attack("router reads prompts outside its queue group", "router", _sub(subjects.INFER), _const(subjects.INFER)),
    Attack("router reads others' replies", "router", _sub(f"{subjects.INBOX_ROOT}.>"),
           _const(f"{subjects.INBOX_ROOT}.>")),
    Attack("health reads prompts", "health", _sub(subjects.INFER, subjects.ROUTER_QUEUE), _const(subjects.INFER)),
    Attack("health forges in-flight deltas", "health", _pub(subjects.INFLIGHT, DELTA), _const(subjects.INFLIGHT)),
    Attack("warmup registers a node", "warmup", _pub(subjects.admin_nodes("add"), NODE),
           _const(subjects.admin_nodes("add"))),
    Attack("warmup writes node state", "warmup", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    # The Batch API: its records, files, work and results are the gateway's and the runners' only.
    Attack("read batch records: open the zml_batch_index bucket", "mallory", _read_kv(subjects.BATCH_INDEX_BUCKET),
           _const(f"$JS.API.STREAM.INFO.KV_{subjects.BATCH_INDEX_BUCKET}")),
    Attack("read batch files: subscribe to the file store", "mallory", _sub(f"$O.{subjects.BATCH_FILES_BUCKET}.>"),
           _const(f"$O.{subjects.BATCH_FILES_BUCKET}.>")),
    Attack("forge a batch line's result", "mallory", _pub(subjects.batch_result("batch_x", 0, 0)),
           _const(subjects.batch_result("batch_x", 0, 0))),
    Attack("take batch work: fetch from the runners' consumer", "mallory",
           _pub(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.BATCH_WORK_STREAM}.{subjects.BATCH_SHARD_CONSUMER}"),
           _const(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.BATCH_WORK_STREAM}.{subjects.BATCH_SHARD_CONSUMER}")),
    Attack("read batch progress: subscribe zml.batch.events", "mallory", _sub(subjects.BATCH_EVENTS),
           _const(subjects.BATCH_EVENTS)),
    Attack("batch runner reads prompts", "batch", _sub(subjects.INFER), _const(subjects.INFER)),
    Attack("batch runner writes node state", "batch", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    Attack("batch runner speaks as the front door", "batch", _pub(subjects.FRONT_DOOR_INFER, _chat()),
           _const(subjects.FRONT_DOOR_INFER)),
    Attack("batch runner mints an API key", "batch", _pub(f"$KV.{subjects.KEYS_BUCKET}.evil"),
           _const(f"$KV.{subjects.KEYS_BUCKET}.evil")),
    Attack("gateway takes batch work", "gateway",
           _pub(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.BATCH_WORK_STREAM}.{subjects.BATCH_SHARD_CONSUMER}"),
           _const(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.BATCH_WORK_STREAM}.{subjects.BATCH_SHARD_CONSUMER}")),
    # An observer (billing, analytics) reads events and node state and does nothing else.
    Attack("observer sends work: zml.infer", "olive", _pub(subjects.INFER, _chat()), _const(subjects.INFER)),
    Attack("observer sets a cost label: zml.gateway.infer", "olive", _pub(subjects.FRONT_DOOR_INFER, _chat()),
           _const(subjects.FRONT_DOOR_INFER)),
    Attack("observer reads prompts", "olive", _sub(subjects.INFER, subjects.ROUTER_QUEUE), _const(subjects.INFER)),
    Attack("observer reads every reply", "olive", _sub(f"{subjects.INBOX_ROOT}.>"), _const(f"{subjects.INBOX_ROOT}.>")),
    Attack("observer reads another's replies", "olive", _sub_alice_inbox, _alice_inbox),
    Attack("observer registers a node", "olive", _pub(subjects.admin_nodes("add"), NODE),
           _const(subjects.admin_nodes("add"))),
    Attack("observer removes a node", "olive", _pub(subjects.admin_nodes("remove")), _const(subjects.admin_nodes("remove"))),
    Attack("observer writes node state", "olive", _pub(f"$KV.{subjects.NODES_BUCKET}.evil", NODE),
           _const(f"$KV.{subjects.NODES_BUCKET}.evil")),
    Attack("observer changes a price", "olive", _pub(f"$KV.{subjects.COSTS_BUCKET}.h100-1"),
           _const(f"$KV.{subjects.COSTS_BUCKET}.h100-1")),
    Attack("observer creates the node bucket with its own settings", "olive",
           _pub(f"$JS.API.STREAM.CREATE.KV_{subjects.NODES_BUCKET}"),
           _const(f"$JS.API.STREAM.CREATE.KV_{subjects.NODES_BUCKET}")),
    Attack("observer forges completion events", "olive", _pub(subjects.event(subjects.EVENT_COMPLETED)),
           _const(subjects.event(subjects.EVENT_COMPLETED))),
    Attack("observer forges warmup events", "olive", _pub(subjects.event(subjects.EVENT_WARMUP)),
           _const(subjects.event(subjects.EVENT_WARMUP))),
    Attack("observer loads models: zml.warmup.serve", "olive", _pub(subjects.WARMUP_SERVE), _const(subjects.WARMUP_SERVE)),
    Attack("observer forces a plan: zml.warmup.plan", "olive", _pub(subjects.WARMUP_PLAN), _const(subjects.WARMUP_PLAN)),
    Attack("observer forges placement events", "olive", _pub(subjects.event(subjects.EVENT_PLACEMENT)),
           _const(subjects.event(subjects.EVENT_PLACEMENT))),
    Attack("observer reads the routers' fleet view", "olive", _pub(subjects.ROUTERS_STATE), _const(subjects.ROUTERS_STATE)),
    Attack("observer reads routing decisions", "olive", _pub(subjects.ROUTERS_DECISION),
           _const(subjects.ROUTERS_DECISION)),
    Attack("observer reads API key hashes", "olive", _read_kv(subjects.KEYS_BUCKET),
           _const(f"$JS.API.STREAM.INFO.KV_{subjects.KEYS_BUCKET}")),
    Attack("observer reads node load: zml.node.inflight", "olive", _sub(subjects.INFLIGHT), _const(subjects.INFLIGHT)),
    Attack("observer watches cancels", "olive", _sub(f"{subjects.CANCEL_PREFIX}.>"), _const(f"{subjects.CANCEL_PREFIX}.>")),
    # Audio bodies over one message go to their router in parts on zml.upload.<router>.<token>.
    Attack("read others' audio: subscribe zml.upload.>", "mallory", _sub(f"{subjects.UPLOAD_PREFIX}.>"),
           _const(f"{subjects.UPLOAD_PREFIX}.>")),
    Attack("observer uploads audio", "olive", _pub(subjects.upload("router-1", "x")),
           _const(subjects.upload("router-1", "x"))),
    Attack("observer reads uploads", "olive", _sub(f"{subjects.UPLOAD_PREFIX}.>"), _const(f"{subjects.UPLOAD_PREFIX}.>")),
    Attack("admin reads prompts", "admin", _sub(subjects.INFER), _const(subjects.INFER)),
    Attack("admin reads every reply", "admin", _sub("_INBOX.>"), _const("_INBOX.>")),
]


def test_services_do_their_jobs_without_a_single_violation(stack: Stack, secure_bus: SecureBus) -> None:
    """Start-up and serving (KV watches, the queue's stream and consumers, deltas, replies)
    stay inside each service's permissions: the server logged no violation for them."""
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=_chat(stream=True), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and "[DONE]" in r.text
    assert httpx.get(stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"][0]["routers"] == 1
    # a batch through the Batch API: the gateway's store, the runner's work, results and files
    line = json.dumps({"custom_id": "p1", "method": "POST", "url": "/v1/chat/completions",
                       "body": json.loads(_chat())})
    f = httpx.post(stack.gateway_url + "/v1/files", data={"purpose": "batch"},
                   files={"file": ("p.jsonl", line.encode())}, timeout=30).json()
    b = httpx.post(stack.gateway_url + "/v1/batches", timeout=30, json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    deadline = time.monotonic() + 60
    while (got := httpx.get(stack.gateway_url + f"/v1/batches/{b['id']}", timeout=10).json())["status"] != "completed":
        assert time.monotonic() < deadline, got
        time.sleep(0.3)
    assert httpx.get(stack.gateway_url + f"/v1/files/{got['output_file_id']}/content", timeout=10).status_code == 200
    time.sleep(1.5)  # a queue fetch cycle and an in-flight snapshot
    services = {public_key(secure_bus.seeds[role]) for role in ("gateway", "router", "health", "warmup", "batch")}
    bad = [line for line in secure_bus.proc.lines if "Violation" in line and any(k in line for k in services)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
async def test_attack_fails_with_a_permissions_violation(stack: Stack, secure_bus: SecureBus, attack: Attack) -> None:
    c = await connect_as(secure_bus, attack.who)
    try:
        await attack.act(c, secure_bus)
        await c.violation(attack.subject(secure_bus))
    finally:
        await c.nc.close()


async def test_no_identity_no_connection(stack: Stack, secure_bus: SecureBus) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(secure_bus.url, allow_reconnect=False, connect_timeout=5)


async def test_a_forged_node_never_reaches_the_fleet(stack: Stack) -> None:
    """After the attacks above, the fleet is the configured one and requests still work."""
    r = httpx.get(stack.gateway_url + "/v1/nodes", timeout=10)
    assert r.status_code == 200 and {n["node_id"] for n in r.json()["nodes"]} == {"h100-1", "a100-1"}


# --- what each identity may do ------------------------------------------------------------------

def test_http_through_the_gateway_works(stack: Stack) -> None:
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=_chat(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["zml"]["node_id"] in {"h100-1", "a100-1"}


@pytest.mark.parametrize("stream", [False, True], ids=["once", "stream"])
def test_client_identity_infers_over_nats_with_the_sdk(stack: Stack, secure_bus: SecureBus,
                                                       monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    monkeypatch.setenv("ZML_NATS_NKEY", secure_bus.seeds["alice"])
    with zml.Client(secure_bus.url, timeout=30) as client:
        if stream:
            with client.infer_stream(MODEL, "hi", max_tokens=4) as stream:
                chunks = [c.text for c in stream]
            assert chunks and stream.done
        else:
            assert client.infer(MODEL, "hi", max_tokens=4).text


async def test_client_reads_its_own_replies_only_on_its_inbox(stack: Stack, secure_bus: SecureBus) -> None:
    c = await connect_as(secure_bus, "alice")
    try:
        reply = await c.nc.request(subjects.INFER, _chat(), timeout=30)
        assert reply.subject.startswith(subjects.inbox_prefix(public_key(secure_bus.seeds["alice"])) + ".")
        assert subjects.H_ERROR_CODE not in (reply.headers or {}), reply.data
        assert not c.errors
    finally:
        await c.nc.close()


async def _slow_request(c: Conn, request_id: str) -> asyncio.Task[Any]:
    """A request that runs for seconds on the sim (many tokens), started in the background."""
    body = _chat(max_tokens=3000, request_id=request_id)
    return asyncio.create_task(c.nc.request(subjects.INFER, body, timeout=60))


def _code(msg: Any) -> str | None:
    return (msg.headers or {}).get(subjects.H_ERROR_CODE)


async def _until_in_flight(stack: Stack, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            nodes = (await http.get(stack.gateway_url + "/v1/nodes")).json()["nodes"]
            if sum(row.get("in_flight", 0) for row in nodes) >= n:
                return
            await asyncio.sleep(0.1)
    raise AssertionError("the request never reached a node")


async def test_owner_cancels_own_request_and_nobody_elses(stack: Stack, secure_bus: SecureBus) -> None:
    alice, bob = await connect_as(secure_bus, "alice"), await connect_as(secure_bus, "bob")
    try:
        alice_owner = public_key(secure_bus.seeds["alice"])
        bob_owner = public_key(secure_bus.seeds["bob"])
        mine = await _slow_request(alice, "shared-id")
        await _until_in_flight(stack)
        # Bob may publish cancels only in his own namespace: reusing Alice's id there does nothing.
        await bob.nc.publish(subjects.cancel("shared-id", bob_owner), b"")
        await flush(bob.nc)
        await asyncio.sleep(1.0)
        assert not mine.done(), "another identity's cancel stopped the request"
        assert not bob.errors
        await alice.nc.publish(subjects.cancel("shared-id", alice_owner), b"")
        reply = await asyncio.wait_for(mine, 20)
        assert _code(reply) == "CANCELLED", reply.data
    finally:
        await alice.nc.close()
        await bob.nc.close()


async def test_duplicate_id_is_refused_for_the_same_owner_only(stack: Stack, secure_bus: SecureBus) -> None:
    alice, bob = await connect_as(secure_bus, "alice"), await connect_as(secure_bus, "bob")
    try:
        first = await _slow_request(alice, "dup-id")
        await _until_in_flight(stack)
        second = await alice.nc.request(subjects.INFER, _chat(request_id="dup-id"), timeout=30)
        assert _code(second) == "DUPLICATE_REQUEST_ID", second.data
        assert "dup-id" in json.loads(second.data)["error"]["message"]
        # Another owner may use the same id at the same time.
        other = await bob.nc.request(subjects.INFER, _chat(request_id="dup-id"), timeout=30)
        assert _code(other) is None, other.data
        # The first request was not disturbed and can still be cancelled by its owner.
        assert not first.done()
        await alice.nc.publish(subjects.cancel("dup-id", public_key(secure_bus.seeds["alice"])), b"")
        assert _code(await asyncio.wait_for(first, 20)) == "CANCELLED"
    finally:
        await alice.nc.close()
        await bob.nc.close()


async def test_admin_identity_manages_nodes_and_a_client_cannot(stack: Stack, secure_bus: SecureBus) -> None:
    admin = await connect_as(secure_bus, "admin")
    try:
        nodes = await list_nodes(admin.nc, timeout=10)
        assert {n.node_id for n in nodes} >= {"h100-1", "a100-1"}
        added = await add_node(admin.nc, NodeSpec(id="extra-1", accelerator="nvidia_a100",
                                                  endpoint="http://127.0.0.1:9", models=[MODEL]), timeout=10)
        assert added.node.id == "extra-1"
        assert (await remove_node(admin.nc, "extra-1", timeout=10)).node_id == "extra-1"
    finally:
        await admin.nc.close()
    client = await connect_as(secure_bus, "alice")
    try:
        with pytest.raises(Exception):
            await list_nodes(client.nc, timeout=2)
        await client.violation(subjects.admin_nodes("list"))
    finally:
        await client.nc.close()


def _creds(bus: SecureBus, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zml.cli", "creds", *args, "--data-dir", str(bus.data_dir)],
                          capture_output=True, text=True, timeout=60)


async def test_issue_and_revoke_take_effect_without_a_restart(stack: Stack, secure_bus: SecureBus) -> None:
    server_pid = secure_bus.proc.pid
    out = _creds(secure_bus, "issue", "carol")
    assert out.returncode == 0, out.stderr
    assert "reloaded" in out.stdout
    seed = next(line.split()[2] for line in out.stdout.splitlines() if line.startswith("seed file:"))
    assert Path(seed).stat().st_mode & 0o777 == 0o600
    secure_bus.seeds["carol"] = seed
    seed_text = Path(seed).read_text()
    carol = await connect_as(secure_bus, "carol")
    try:
        reply = await carol.nc.request(subjects.INFER, _chat(), timeout=30)
        assert _code(reply) is None, reply.data
        out = _creds(secure_bus, "revoke", "carol")
        signalled = time.monotonic()  # the CLI has rewritten auth.conf and sent the reload signal
        assert out.returncode == 0 and "reloaded" in out.stdout, out.stdout + out.stderr
        assert not Path(seed).exists()
        deadline = signalled + 10
        while carol.nc.is_connected and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not carol.nc.is_connected, "a revoked identity stayed connected"
        # Bounded by the server's config reload (ms); 1 s leaves room for a busy box.
        assert time.monotonic() - signalled <= 1.0, f"disconnected {time.monotonic() - signalled:.2f} s after the reload"
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(secure_bus.url, allow_reconnect=False, connect_timeout=5, nkeys_seed_str=seed_text)
    finally:
        await carol.nc.close()
    assert secure_bus.proc.alive() and secure_bus.proc.pid == server_pid  # reloaded, not restarted
    # The services were not disturbed.
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=_chat(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert not _identities.get(secure_bus.data_dir, "carol")



async def test_http_duplicate_id_from_the_same_caller_is_409_and_the_first_still_runs(stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "request_id": "http-dup",
            "max_tokens": 3000, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", stack.gateway_url + "/v1/chat/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the first request is running
            second = await http.post(stack.gateway_url + "/v1/chat/completions", json={**body, "stream": False})
            assert second.status_code == 409, second.text
            assert second.json()["error"]["code"] == "DUPLICATE_REQUEST_ID"
            more = await anext(lines)
            assert more.startswith("data: ") or more == ""
    # The id is free again once the first request has ended (closing the stream cancelled it).
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(stack.gateway_url + "/v1/chat/completions", timeout=30,
                       json={**body, "stream": False, "max_tokens": 2})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert r.status_code == 200, r.text


def test_sdk_says_what_is_wrong_with_an_identity(stack: Stack, secure_bus: SecureBus,
                                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A client identity asking for node state is told it may not (not a bare TIMEOUT); a seed
    the server does not know is AUTH_FAILED, not "is zml up running?"."""
    monkeypatch.setenv("ZML_NATS_NKEY", secure_bus.seeds["alice"])
    with zml.Client(secure_bus.url, timeout=2, max_retries=0) as client:
        with pytest.raises(zml.AuthError, match="may not use zml.admin.nodes.list"):
            client.nodes()
    stranger = tmp_path / "stranger.nk"
    stranger.write_text(_identities._new_seed() + "\n")
    monkeypatch.setenv("ZML_NATS_NKEY", str(stranger))
    with zml.Client(secure_bus.url, timeout=5) as client:
        with pytest.raises(zml.AuthError, match="refused identity U"):
            client.infer(MODEL, "hi", max_tokens=1)


async def test_observer_reads_events_node_state_and_prices_without_a_violation(stack: Stack,
                                                                                secure_bus: SecureBus) -> None:
    """What an observer is for: every completion event (with its label and tokens), the node
    list from health, and a watch of node state and prices, all without a permissions violation."""
    c = await connect_as(secure_bus, "olive")
    try:
        sub = await c.nc.subscribe(f"{subjects.EVENTS_PREFIX}.>")
        await flush(c.nc)
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(stack.gateway_url + "/v1/chat/completions", content=_chat(),
                                headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        request_id = r.json()["zml"]["request_id"]
        deadline = time.monotonic() + 10
        while True:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            event = json.loads(msg.data)
            if msg.subject == subjects.event(subjects.EVENT_COMPLETED) and event.get("request_id") == request_id:
                break
        assert event.get("ok", True) and event.get("completion_tokens", 0) > 0, event  # defaults are omitted on the wire and event["node_id"] in {"h100-1", "a100-1"}
        nodes = await list_nodes(c.nc)
        assert {n.node_id for n in nodes} == {"h100-1", "a100-1"}
        kv = await c.nc.jetstream().key_value(subjects.NODES_BUCKET)
        assert {k for k in await kv.keys()} >= {"h100-1", "a100-1"}
        seen: list[str] = []
        watcher = await kv.watchall()
        async for entry in watcher:
            if entry is None:
                break
            seen.append(entry.key)
        await watcher.stop()
        assert "h100-1" in seen
        await c.nc.jetstream().key_value(subjects.COSTS_BUCKET)  # prices (zml cost set) are readable
        await flush(c.nc)
        assert not [e for e in c.errors if "violation" in e.lower()], c.errors
    finally:
        await c.nc.close()
