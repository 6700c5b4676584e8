"""zml_router.replicas.deltas against a real nats-server: a node's moves are summed over the window (a
request that starts and ends within it sends nothing), one InflightDelta per node per window,
and a snapshot goes out after the deltas summed before it, never before them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import pytest

from zml_router.replicas.deltas import DeltaWindow
from zmlcore import subjects
from zmlcore.messages import InflightDelta


@pytest.fixture()
async def nc(nats_url: str) -> AsyncIterator[Any]:
    c = await nats.connect(nats_url)
    yield c
    await c.close()


async def listen(nc: Any) -> tuple[list[Any], Any]:
    got: list[Any] = []

    async def on(msg: Any) -> None:
        # Only this test's window (router "r1", snapshot b"snap"): the session's broker also
        # carries the in-flight traffic of other suites' routers still running.
        if msg.subject == subjects.INFLIGHT_SNAPSHOT and msg.data == b"snap":
            got.append((msg.subject, msg.data))
        elif msg.subject == subjects.INFLIGHT and msgspec.json.decode(msg.data, type=InflightDelta).router_id == "r1":
            got.append((msg.subject, msg.data))
    # One subscription for both subjects: nats-py runs each subscription's callbacks in its own
    # task, so two of them could reorder what the wire delivered in order.
    prefix = subjects.INFLIGHT.rsplit(".", 1)[0]
    assert subjects.INFLIGHT_SNAPSHOT.rsplit(".", 1)[0] == prefix
    return got, await nc.subscribe(prefix + ".*", cb=on)


async def settle(got: list[Any], n: int) -> None:
    for _ in range(250):
        if len(got) >= n:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.4)  # and nothing more comes


async def test_moves_are_summed_per_node_and_a_round_trip_sends_nothing(nc: Any) -> None:
    got, _ = await listen(nc)
    w = DeltaWindow(nc, "r1", window_s=0.05)
    w.add("a", 1, 1)
    w.add("a", -1, -1)  # started and ended within the window
    w.add("b", 1, 1)
    w.add("b", 0, -1)
    w.add("b", 1, 1)
    await settle(got, 1)
    deltas = [msgspec.json.decode(d, type=InflightDelta) for s, d in got if s == subjects.INFLIGHT]
    assert [(d.router_id, d.node_id, d.outstanding, d.pending) for d in deltas] == [("r1", "b", 2, 1)]
    w.close()


async def test_a_snapshot_follows_the_deltas_summed_before_it(nc: Any) -> None:
    got, _ = await listen(nc)
    w = DeltaWindow(nc, "r1", window_s=0.3)
    w.add("a", 1, 1)
    await w.then(subjects.INFLIGHT_SNAPSHOT, lambda: b"snap")  # within the window: the delta first
    w.add("a", 1, 0)  # after the snapshot was read: after it on the wire
    await settle(got, 3)
    w.close()
    kinds = [s for s, _ in got]
    assert kinds == [subjects.INFLIGHT, subjects.INFLIGHT_SNAPSHOT, subjects.INFLIGHT], got
