"""The router's flow gate counts what the other replicas may be doing that its table cannot
show yet (zml_router.request.flowgate, zmlcore.flowctl.gate.unseen_by_peers): its own recent
sends, once per peer, and slots a peer freed a moment ago (that peer refills them)."""

from __future__ import annotations

import asyncio
import time

from zmlcore.config import parse_config
from zmlcore.messages import InflightSnapshot, NodeState
from zmlcore.policy import RoutingState
from zmlcore.policy.prefix import PrefixIndex
from zml_router.replicas.table import NodeTable
from zml_router.request import flowgate
from zml_router.request.flowgate import FlowGate, Note
from zmlcore.flowctl import STANDARD, Ask


def _note(yields: bool) -> Note:
    return Note(Ask(STANDARD, False, "t", 1.0, None), yields=yields)


def _gate(hold: bool = True, peers: int = 1) -> FlowGate:
    cfg = parse_config({"flow": {"hold_when_full": hold}})
    table = NodeTable(cfg.families())
    table.upsert(NodeState(node_id="n1", accelerator_type="amd_mi300x", family="MI300X", endpoint="http://x",
                           status="up", models=["m"], updated_at=time.time()))
    for i in range(peers):
        table.apply_snapshot(InflightSnapshot(router_id=f"peer-{i}", ts=time.time(), nodes={}), time.time())
    return FlowGate(cfg, table, RoutingState(), PrefixIndex(), "me")


async def test_own_recent_sends_count_once_per_peer_then_expire() -> None:
    gate = _gate(peers=2)
    woken = asyncio.Event()
    gate.freed = woken.set
    gate.sent("n1", _note(False))
    gate.sent("n1", _note(True))  # a send that takes spare capacity only (a flood over its share)
    assert gate._unseen(yields=True) == {"n1": 4}
    assert gate._unseen(yields=False) == {"n1": 2}  # it left the reserve: not counted against others
    await asyncio.wait_for(woken.wait(), 1.0)  # the queue is told to try again once they expire
    await asyncio.sleep(flowgate.UNSEEN_S)
    assert gate._unseen(yields=True) == {}


async def test_a_slot_a_peer_freed_stays_its_for_a_moment() -> None:
    gate = _gate()
    woken = asyncio.Event()
    gate.freed = woken.set
    gate.peer_freed("n1", 2)
    assert gate._unseen(yields=False) == {"n1": 2} == gate._unseen(yields=True)
    await asyncio.wait_for(woken.wait(), 1.0)
    await asyncio.sleep(0.01)
    assert gate._unseen(yields=False) == {}


async def test_alone_or_without_hold_when_full_nothing_is_unseen() -> None:
    alone = _gate(peers=0)
    alone.sent("n1", _note(False))
    assert alone._unseen(yields=True) == {}
    free = _gate(hold=False)
    free.sent("n1", _note(False))
    free.peer_freed("n1", 1)
    assert free._unseen(yields=True) == {}
