"""A replica reads its peers' in-flight deltas and snapshots in the order they were sent.

They travel on two subjects. With a callback subscription each, nats-py hands each subject's
messages to its own task: a delta sent after a snapshot could be applied before it, and the
older snapshot then replaced the peer's counts, the delta lost until the next snapshot (a CI
run: one replica saw 12 requests in flight, the other 7). Real nats-server."""

from __future__ import annotations

import asyncio
import time

import msgspec

from zmlcore import subjects
from zmlcore.bus.connect import connect
from zmlcore.bus.publish import flush
from zmlcore.config import parse_config
from zmlcore.messages import InflightDelta, InflightSnapshot, NodeState
from zml_router.replicas.cooldowns import Marks
from zml_router.replicas.inflight import Sharing
from zml_router.replicas.table import NodeTable

ROUNDS = 200


async def test_deltas_after_a_snapshot_are_never_undone_by_it(nats_url: str) -> None:
    table = NodeTable(parse_config({}).families())
    table.upsert(NodeState(node_id="n1", accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                           status="up", models=["m"], updated_at=time.time()))
    peer_nc = await connect(nats_url, "zml-test-peer")
    nc = await connect(nats_url, "zml-test-replica")
    sharing = Sharing(table, Marks(table, "r-b"), "r-b")
    subs = await sharing.start(nc, lambda: None)
    await flush(nc)
    try:
        # Hostile or broken peers first: not JSON, wrong types, deep, huge. Each is dropped in the
        # reader (which must keep reading: the counts below still arrive).
        for junk in (b"\x00\xff{", b'["r-a","n1","x",0,1]', b"[" * 5000, b'{"router_id":"r-a","ts":1,"nodes":' +
                     b'{"n1":[1,"z"]}}', b"7" * 500_000):
            await peer_nc.publish(subjects.INFLIGHT, junk)
            await peer_nc.publish(subjects.INFLIGHT_SNAPSHOT, junk)
        count = 0
        for _ in range(ROUNDS):
            # What the peer's DeltaWindow sends around a snapshot: a move, the snapshot that
            # counts it, a later move; all in one write, as on a busy router.
            await peer_nc.publish(subjects.INFLIGHT, msgspec.json.encode(
                InflightDelta(router_id="r-a", node_id="n1", outstanding=1, pending=0, ts=time.time())))
            count += 1
            await peer_nc.publish(subjects.INFLIGHT_SNAPSHOT, msgspec.json.encode(
                InflightSnapshot(router_id="r-a", ts=time.time(), nodes={"n1": (count, 0)})))
            await peer_nc.publish(subjects.INFLIGHT, msgspec.json.encode(
                InflightDelta(router_id="r-a", node_id="n1", outstanding=2, pending=0, ts=time.time())))
            count += 2
        await flush(peer_nc)
        deadline = time.monotonic() + 5
        while table.peers.get("r-a", (0, {}))[1].get("n1", [0])[0] != count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert table.peers["r-a"][1]["n1"][0] == count
        assert table.views["n1"].outstanding == count
    finally:
        for sub in subs:
            await sub.unsubscribe()
        sharing.close()
        await nc.close()
        await peer_nc.close()


async def test_two_replicas_know_each_other_as_soon_as_the_second_starts(nats_url: str) -> None:
    """A replica counts a peer (and sends it deltas) only once it has heard its snapshot, sent
    every second: the first goes out at start, and a replica that hears a new peer answers with
    its own at once. Before, two routers started together ignored each other's sends for up to a
    second, and a burst reaching both was admitted by each to every free slot of a node
    (tests/e2e/test_flow_control.py)."""
    def replica(rid: str) -> tuple[NodeTable, Sharing]:
        table = NodeTable(parse_config({}).families())
        table.upsert(NodeState(node_id="n1", accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                               status="up", models=["m"], updated_at=time.time()))
        return table, Sharing(table, Marks(table, rid), rid)

    (ta, a), (tb, b) = replica("r-a"), replica("r-b")
    nca, ncb = await connect(nats_url, "zml-test-a"), await connect(nats_url, "zml-test-b")
    subs = await a.start(nca, lambda: None)
    loops = [asyncio.create_task(a.publish_snapshots())]
    try:
        await asyncio.sleep(0.3)  # a runs alone (its first snapshot heard by nobody)
        subs += await b.start(ncb, lambda: None)
        await flush(ncb)
        loops.append(asyncio.create_task(b.publish_snapshots()))
        deadline = time.monotonic() + 0.5  # well before a's next snapshot (1 s after its first)
        while not ("r-b" in ta.peers and "r-a" in tb.peers) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert "r-b" in ta.peers and "r-a" in tb.peers, (ta.peers, tb.peers)
        b.move("n1", 1, 0)  # and b's sends reach a from its first one
        deadline = time.monotonic() + 2
        while ta.views["n1"].outstanding != 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ta.views["n1"].outstanding == 1
    finally:
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for sub in subs:
            await sub.unsubscribe()
        a.close()
        b.close()
        await nca.close()
        await ncb.close()
