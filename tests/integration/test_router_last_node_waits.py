"""A first token later than the first-byte deadline on every node: the router moves on from a
slow node only while another could take the request. Its last choice (no other node up, or its
last attempt) is waited for to the request's own deadline, not answered 502 "all were slow"."""

from __future__ import annotations

import json
import tempfile
import time

import msgspec
import pytest

from test_health_helpers import start_sim
from zml_sim.engine import Faults
from zmlcore import subjects
from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure_kv
from zmlcore.config import parse_config
from zmlcore.messages import NodeState
from zmlcore.runtime.launch import free_port, start_nats
from zml_router.service import RouterService

from test_health_helpers import eventually

M = "llama-3-8b"
DEADLINE_S = 0.25  # the first-byte deadline of every attempt (floor, no factor)
#: Real time: ~0.8 s to the first token of these prompts on either node, three deadlines and more.
SLOW = Faults(slowdown=8.0)


def _prompt(i: int) -> str:  # a prompt of its own each time: nothing cached on either node
    return f"{i} " + "word " * 1000


def _state(node_id: str, endpoint: str) -> bytes:
    return msgspec.json.encode(NodeState(node_id=node_id, accelerator_type="nvidia_h100", family="H100",
                                         endpoint=endpoint, status="up", models=[M], max_concurrency=8,
                                         updated_at=time.time()))


@pytest.mark.parametrize("max_attempts", [3, 1])
async def test_the_last_node_left_is_waited_for_past_the_first_byte_deadline(max_attempts: int) -> None:
    sims = [await start_sim(n, "nvidia_h100", [M], time_scale=1.0, faults=SLOW) for n in ("h100-a", "h100-b")]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-lastnode-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        url = f"nats://127.0.0.1:{port}"
        health = await connect(url, "health")
        nc = await connect(url, "router")
        client = await connect(url, "client")
        cfg = parse_config({"router": {"first_byte_floor_s": DEADLINE_S, "first_byte_factor": 0,
                                       "max_attempts": max_attempts, "cooldown_s": 30}})
        svc = RouterService(cfg, "r-last")
        try:
            kv = await ensure_kv(health.jetstream(), subjects.NODES_BUCKET)
            await svc.start(nc)
            for sim in sims:
                await kv.put(sim.node_id, _state(sim.node_id, sim.url))
            await eventually(lambda: len(svc.table.views) == 2, what="the router's table")
            for i, stream in enumerate((False, True)):
                body = {"model": M, "messages": [{"role": "user", "content": _prompt(i)}], "max_tokens": 2,
                        "stream": stream}
                t0 = time.monotonic()
                if stream:
                    inbox = client.new_inbox()
                    sub = await client.subscribe(inbox)
                    await client.publish(subjects.INFER, json.dumps(body).encode(), reply=inbox)
                    first = await sub.next_msg(timeout=20)
                    headers = first.headers or {}
                    await sub.unsubscribe()
                    data = first.data
                else:
                    msg = await client.request(subjects.INFER, json.dumps(body).encode(), timeout=20)
                    headers, data = msg.headers or {}, msg.data
                took = time.monotonic() - t0
                assert subjects.H_ERROR_CODE not in headers, (stream, data[:500])
                assert took > 2 * DEADLINE_S, (took, headers, data[:300])  # it did wait past a deadline
                routing = json.loads(data).get("zml") or json.loads(data).get("routing") or {}
                if max_attempts == 3 and not stream:
                    # the first node was left at its deadline for the other, which was then the last
                    assert routing.get("attempts") == 2, routing
        finally:
            await svc.stop()
            for c in (client, nc, health):
                await c.close()
            proc.stop()
            for sim in sims:
                await sim.stop()
