"""A request handed to the saturation queue is never its own duplicate (CI: the queued request
``q-keeps`` of tests/e2e/test_router_behaviour.py answered DUPLICATE_REQUEST_ID), on a real broker
with a router and a sim node in process.

A request's attempt puts it in the queue (every node refused it) and only then ends. If this
router's queue worker takes the new entry, finds room and starts it before that attempt has let
go of its slot in ``in_flight``, the queued attempt must not be refused as a duplicate of the
attempt that queued it. The window is the queue publish's JetStream ack: the entry is stored and
delivered to the consumer before the publisher has read its ack. Here that ack comes back late on
purpose (as on a loaded broker or host), which makes the window wide enough to hit every time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from test_health_helpers import connected, eventually, node_entry, private_nats, start_sim
from zmlcore import subjects
from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure_kv
from zmlcore.config import parse_config
from zmlcore.messages import NodeState
from zml_router.queue import glue as saturation
from zml_router.service import RouterService
from zml_sim.server import SimNode

M = "requeue/model"
#: How late the queue publish's ack comes back: longer than a saturated mark lasts (saturated_s).
ACK_LATE_S = 1.0


@dataclass
class Harness:
    nc: NATS
    sim: SimNode
    svc: RouterService
    #: Queue publishes so far, and from which one on their acks come back late.
    publishes: list[float] = field(default_factory=list)
    late_from: int = 1

    def faults(self, **faults: Any) -> None:
        self.sim.engine.faults = self.sim.engine.faults.updated(faults)

    def served(self) -> int:
        return sum(self.sim.engine.stats_for(M).success.values())


@pytest.fixture()
async def harness() -> AsyncIterator[Harness]:
    with private_nats() as url:
        sim = await start_sim("h100-1", "nvidia_h100", [M])
        cfg = parse_config({
            "nodes": [node_entry(sim)],
            # Marks from a refusal ("Retry-After: 0") last saturated_s: the head finds room again soon.
            "router": {"saturated_s": 0.2, "stale_after_s": 600},
            "policies": {"queued": {"accelerator_chain": ["H100"], "queue_on_saturation": True,
                                    "max_queue_ms": 20000}},
        }, "test")
        router_nc = await connect(url, "router")  # as the router connects (zmlcore.bus.connect)
        async with connected(url) as writer, connected(url) as nc:
            kv = await ensure_kv(writer.jetstream(), subjects.NODES_BUCKET)
            await kv.put(sim.node_id, msgspec.json.encode(NodeState(
                node_id=sim.node_id, accelerator_type="nvidia_h100", family="H100", endpoint=sim.url,
                backend=sim.engine_kind, status="up", models=[M], max_concurrency=8, updated_at=time.time())))
            svc = RouterService(cfg, "r-requeue")
            await svc.start(router_nc)
            h = Harness(nc, sim, svc)
            await eventually(lambda: sim.node_id in svc.table.views, what="the router's table")
            await eventually(lambda: _answers(nc), what="the router answering on zml.infer")
            queue = svc.glue.queue
            assert queue is not None
            real = queue.js.publish

            async def late_ack(subject: str, *args: Any, **kwargs: Any) -> Any:
                ack = await real(subject, *args, **kwargs)  # stored (and delivered) already
                if subject.startswith(subjects.QUEUE_SUBJECT_PREFIX + "."):
                    h.publishes.append(time.monotonic())
                    if len(h.publishes) >= h.late_from:
                        await asyncio.sleep(ACK_LATE_S)
                return ack

            queue.js.publish = late_ack  # type: ignore[method-assign]
            try:
                yield h
            finally:
                await svc.stop()
                await router_nc.close()
                await sim.stop()


async def _answers(nc: NATS) -> bool:
    """Does a router answer on zml.infer (a body it refuses), not the broker's "no responders"?"""
    try:
        msg = await nc.request(subjects.INFER, b"{}", timeout=2)
    except Exception:  # no responders (or no answer yet)
        return False
    return bool((msg.headers or {}).get(subjects.H_ERROR_CODE))


async def _ask(h: Harness, request_id: str) -> Any:
    """Publish a queued-policy request raw on zml.infer; the subscription its answer comes to."""
    inbox = h.nc.new_inbox()
    sub = await h.nc.subscribe(inbox)
    body = {"model": M, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "policy": "queued",
            "request_id": request_id}
    await h.nc.publish(subjects.INFER, json.dumps(body).encode(), reply=inbox)
    return sub


async def _queued(h: Harness, sub: Any, times: int) -> None:
    """Until the request has gone into the queue ``times`` times (failing with its answer if one
    came first)."""
    await eventually(lambda: len(h.publishes) >= times or sub.pending_msgs, timeout=10,
                     what=f"the request queued {times} time(s)")
    if len(h.publishes) < times:
        answer = await sub.next_msg(timeout=1)
        raise AssertionError(f"answered before it was queued {times} time(s): {answer.headers} {answer.data!r}")


async def test_a_request_queued_by_its_first_attempt_is_not_its_own_duplicate(harness: Harness) -> None:
    h = harness
    h.faults(overload=True, retry_after_s=0)
    sub = await _ask(h, "q-self")
    # Refused at once, queued; its ack is late, and the node has room again before it comes.
    await _queued(h, sub, 1)
    h.faults(overload=False)
    first = await sub.next_msg(timeout=20)
    assert subjects.H_ERROR_CODE not in (first.headers or {}), first.data
    assert json.loads(first.data)["choices"][0]["message"]["content"]
    assert h.served() == 1
    assert not h.svc.in_flight


async def test_a_head_refused_after_its_placement_wait_is_not_its_own_duplicate(harness: Harness) -> None:
    """The CI case: under load a node's refusal came after PLACEMENT_WAIT_S, so the queue took the
    head as placed (acknowledged it) and the attempt, refused, put the request back in the queue,
    where this router's worker met it again while that attempt still held its slot."""
    h = harness
    h.late_from = 2  # the first queueing goes as usual; the head's re-queueing gets its ack late
    h.faults(overload=True, retry_after_s=0, overload_delay_s=saturation.PLACEMENT_WAIT_S + 0.3)
    sub = await _ask(h, "q-slow")
    # Queued by its first attempt, taken as placed by the queue, refused slowly, queued again,
    # and (its ack late) out of the queue again: then the node gets room.
    await _queued(h, sub, 2)
    await asyncio.sleep(0.5)  # the re-queued head out of the queue (saturated_s 0.2) and on the node
    h.faults(overload=False, overload_delay_s=0.0)
    first = await sub.next_msg(timeout=20)
    assert subjects.H_ERROR_CODE not in (first.headers or {}), first.data
    assert json.loads(first.data)["choices"][0]["message"]["content"]
    assert h.served() == 1
    assert not h.svc.in_flight
