"""What /dashboard/state says on a real nats-server (issue 27 items 2, 4, 7): each node's speeds
with their source and age, why a node is down and since when; the saturation queue by the
running config's model names (not the hashed keys of an earlier config's durable consumers);
the batches the store holds, not only those whose events this gateway happened to hear."""

from __future__ import annotations

import time

import msgspec
import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from zmlcore import subjects
from zmlcore.batch.store import BatchStore
from zmlcore.config import BatchConfig
from zmlcore.fleet.costs import CostTable
from zmlcore.messages import NodeState
from zmlcore.messages.batch import BatchRecord
from zml_gateway.dashboard import Dashboard
from zml_gateway.nodetable import NodeTable


async def test_the_state_says_where_each_belief_comes_from(own_nats: str) -> None:
    nc = await nats.connect(own_nats)
    try:
        js = nc.jetstream()
        # The saturation queue as a router leaves it: a durable consumer per model, one of a
        # model the running config no longer has (an earlier `zml up` on the same store).
        await js.add_stream(StreamConfig(name=subjects.QUEUE_STREAM, subjects=[f"{subjects.QUEUE_SUBJECT_PREFIX}.>"],
                                         retention=RetentionPolicy.WORK_QUEUE))
        for model in ("demo/old-model", "acme/chat"):
            key = subjects.queue_key(model)
            await js.add_consumer(subjects.QUEUE_STREAM, ConsumerConfig(
                durable_name=subjects.queue_consumer(key), filter_subject=subjects.queue(key),
                ack_policy=AckPolicy.EXPLICIT))
        for _ in range(2):
            await js.publish(subjects.queue(subjects.queue_key("demo/old-model")), b"{}")
        # Two owners' batches, created before this dashboard existed (no event of theirs heard).
        store = await BatchStore.open(nc, BatchConfig(max_store_bytes=64 * 1024 * 1024))
        now = time.time()
        for owner, bid, status, done in (("key:a", "batch_a", "in_progress", None),
                                         ("key:b", "batch_b", "completed", int(now) - 3600)):
            await store.create_batch(BatchRecord(id=bid, owner=owner, endpoint="/v1/chat/completions",
                                                 input_file_id="file-x", completion_window="24h",
                                                 created_at=int(now) - 7200, expires_at=int(now) + 9999,
                                                 status=status, completed_at=done, total=10,  # type: ignore[arg-type]
                                                 progress={"0": [7, 1, 0, 0]}))
        nodes = {
            "cpu-1": NodeState(node_id="cpu-1", accelerator_type="cpu", family="CPU", endpoint="http://c",
                               status="down", reason="connection refused", last_ok=now - 35, updated_at=now - 1,
                               prefill_tps=450.0, decode_tps=7.5, speeds_measured=True, speeds_source="measured",
                               speeds_at=now - 4, note="no node probe (GET /zml/v1/node): hardware not validated"),
            "h100-1": NodeState(node_id="h100-1", accelerator_type="nvidia_h100", family="H100", endpoint="http://h",
                                status="up", updated_at=now, prefill_tps=10_000.0, decode_tps=60.0,
                                missing_models=["acme/chat"]),
        }
        board = Dashboard(nc, None, NodeTable(nc, nodes, CostTable()), models=lambda: {"acme/chat"},  # type: ignore[arg-type]
                          batch_store=store)
        state = msgspec.json.decode(await board.state_json())
        assert state["queue"] == {"acme/chat": 0} and state["queue_other_models"] == 2
        assert [(b["id"], b["status"], b["completed"], b["failed"]) for b in state["batches"]] == [
            ("batch_a", "in_progress", 7, 1), ("batch_b", "completed", 7, 1)]  # unfinished first
        assert 3590 < state["batches"][1]["updated_s"] < 3700
        down, up = sorted(state["nodes"], key=lambda n: n["node_id"])
        assert down["reason"] == "connection refused" and 34 <= down["down_for_s"] < 45
        assert (down["speeds_source"], down["prefill_tps"]) == ("measured", 450.0) and 3 <= down["speeds_age_s"] < 15
        assert down["note"].endswith("hardware not validated")
        # an older health service's state (no speeds_source): the type's profile, no age
        assert (up["speeds_source"], up["speeds_age_s"], up["down_for_s"]) == ("default", None, None)
        assert up["missing_models"] == ["acme/chat"]
    finally:
        await nc.close()


async def test_the_state_shows_tenant_shares_and_what_waits_by_band(own_nats: str) -> None:
    """Flow control on the dashboard (issue 30): each router replica's share report on
    zml.flow.shares, summed: every tenant's part of the recent weighted tokens, its requests
    waiting in the saturation queue (in any replica's window), and what waits by band."""
    import asyncio

    from zmlcore.flowctl import ShareBook
    nc = await nats.connect(own_nats)
    try:
        board = Dashboard(nc, None, NodeTable(nc, {}, CostTable()))  # type: ignore[arg-type]
        await board.start()
        state = msgspec.json.decode(await board.state_json())
        assert state["flow"] is None  # nothing reported: no flow control in use
        now = time.time()
        r1, r2 = ShareBook("router-1"), ShareBook("router-2")
        r1.charge("key:flood", 3000.0, now)
        r1.charge("key:steady", 500.0, now)
        r1.set_waiting({"key:flood": 30}, {"standard": 30})
        r2.charge("key:flood", 1500.0, now)
        r2.set_waiting({"key:flood": 6, "key:vip": 1}, {"standard": 6, "critical": 1})
        for book in (r1, r2):
            await nc.publish(subjects.FLOW_SHARES, msgspec.json.encode(book.report(now)))
        await nc.flush()
        deadline = time.monotonic() + 5
        while len(board.shares) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        board._cached = None
        flow = msgspec.json.decode(await board.state_json())["flow"]
        assert flow["replicas"] == 2
        assert flow["tenants"][0] == {"tenant": "key:flood", "share": 0.9, "tokens": 4500, "waiting": 36}
        assert flow["tenants"][1] == {"tenant": "key:steady", "share": 0.1, "tokens": 500, "waiting": 0}
        assert flow["tenants"][2]["tenant"] == "key:vip" and flow["tenants"][2]["waiting"] == 1
        assert flow["waiting_by_band"] == {"critical": 1, "standard": 36}  # in band order
        await board.stop()
    finally:
        await nc.close()
