"""The router's state reply and queue announcements as Structs (zmlcore.messages.router)."""

from __future__ import annotations

import time

import msgspec

from zmlcore.config import parse_config
from zmlcore.messages import NodeState, QueueBusy, queue_busy_decoder, router_state_decoder
from zml_router.replicas.cooldowns import Marks
from zml_router.replicas.inflight import Sharing
from zml_router.replicas.table import NodeTable


def test_state_reply_fields() -> None:
    cfg = parse_config({})
    table = NodeTable(cfg.families())
    now = time.time()
    for node_id in ("a", "b"):
        table.upsert(NodeState(node_id=node_id, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                               status="up", models=["m"], updated_at=now - 1))
    marks = Marks(table, "r1")
    marks.mark("a", "cooldown", 10.0, "network", now)
    table.add_own("b", 2, 1)
    raw = msgspec.json.encode(Sharing(table, marks, "r1").state(3, now))
    doc = msgspec.json.decode(raw)
    assert doc["router_id"] == "r1" and doc["in_flight"] == 3
    a, b = doc["nodes"]["a"], doc["nodes"]["b"]
    assert a["cooldown_s"] > 9 and a["cooldown_reason"] == "network" and a["cooldown_by"] == "r1"
    # Only a cooling node says why (as the dict reply did).
    assert set(b) == {"status", "outstanding", "pending", "own", "effective_outstanding", "cooldown_s",
                      "saturated_s", "state_age_s", "cost_per_hour"}
    assert b["own"] == [2, 1] and b["outstanding"] == 2 and b["state_age_s"] >= 1
    assert router_state_decoder.decode(raw).nodes["b"].pending == 1


def test_queue_busy_round_trip_and_hostile_input() -> None:
    raw = msgspec.json.encode(QueueBusy(key="m-1234abcd", until=12.5))
    assert queue_busy_decoder.decode(raw) == QueueBusy(key="m-1234abcd", until=12.5)
    for bad in (b"m-1234abcd 12.5", b"{}", b'{"key": 1, "until": "x"}', b"\xff"):
        try:
            queue_busy_decoder.decode(bad)
        except msgspec.DecodeError:
            continue
        raise AssertionError(bad)
