"""Pure pieces of issue 8's router work: shared marks, the first-byte deadline, stream
sequence checks."""

from __future__ import annotations

from zmlcore.messages import NodeMark, NodeState, node_mark_decoder
from zmlcore.reply.streamseq import SeqCheck
from zml_router.replicas.cooldowns import Marks
from zml_router.node.attempt import Learned, first_byte_timeout
from zml_router.replicas.table import NodeTable


def _table(*ids: str) -> NodeTable:
    t = NodeTable()
    for i in ids:
        t.upsert(NodeState(node_id=i, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                           status="up", models=["m"]))
    return t


def test_own_mark_applies_locally_and_is_published_for_peers() -> None:
    t = _table("n1")
    mark = Marks(t, "r1").mark("n1", "cooldown", 30.0, "slow", now=100.0)
    assert mark is not None and t.views["n1"].cooldown_until == 130.0
    assert node_mark_decoder.decode(b'{"router_id":"r1","node_id":"n1","kind":"cooldown","for_s":30.0}') == \
        NodeMark(router_id="r1", node_id="n1", kind="cooldown", for_s=30.0)


def test_peer_marks_extend_never_shorten_and_own_echoes_are_ignored() -> None:
    t = _table("n1")
    m = Marks(t, "r2")
    assert m.apply_peer(NodeMark(router_id="r1", node_id="n1", kind="cooldown", for_s=30, reason="server"), 100.0)
    assert t.views["n1"].cooldown_until == 130.0
    assert m.describe("n1", 110.0) == {"cooldown_reason": "server", "cooldown_by": "r1"}
    assert not m.apply_peer(NodeMark(router_id="r3", node_id="n1", kind="cooldown", for_s=5), 100.0)
    assert t.views["n1"].cooldown_until == 130.0
    assert not m.apply_peer(NodeMark(router_id="r2", node_id="n1", kind="cooldown", for_s=60), 100.0)
    assert m.apply_peer(NodeMark(router_id="r1", node_id="n1", kind="saturated", for_s=2), 100.0)
    assert t.views["n1"].saturated_until == 102.0


def test_hostile_marks_are_bounded_or_ignored() -> None:
    t = _table("n1")
    m = Marks(t, "r2")
    assert m.apply_peer(NodeMark(router_id="x", node_id="n1", kind="cooldown", for_s=1e12), 0.0)
    assert t.views["n1"].cooldown_until == 3600.0  # an hour at most
    assert not m.apply_peer(NodeMark(router_id="x", node_id="nope", kind="cooldown", for_s=5), 0.0)
    assert not m.apply_peer(NodeMark(router_id="x", node_id="n1", kind="cooldown", for_s=-5), 0.0)


def test_first_byte_deadline_grows_with_the_work_and_keeps_its_floor() -> None:
    st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    expected_s = Learned(st).expected_s
    idle = expected_s(0, 0, 100, 512, stream=True)
    assert first_byte_timeout(idle, 5.0, 4.0) == 5.0
    busy = expected_s(200, 100, 100, 512, stream=True)  # a prefill backlog and full slots
    assert busy > idle and first_byte_timeout(busy, 5.0, 4.0) == 4.0 * busy
    whole = expected_s(0, 0, 100, 512, stream=False)  # a non-streamed reply comes at the end
    assert whole > idle + 512 / 100
    assert first_byte_timeout(whole, 5.0, 0.0) == 5.0  # factor 0: a fixed timeout


def test_seq_check_reports_losses_duplicates_and_garbage() -> None:
    c = SeqCheck()
    assert [c.gap(s) for s in ("0", "1", None, "2")] == [None, None, None, None]
    assert c.gap("5") == "stream message 3-4 was lost (next one received: 5)"
    assert "out of order" in _dup()
    assert "invalid" in (SeqCheck().gap("x" * 100) or "")


def _dup() -> str:
    c = SeqCheck()
    c.gap("0")
    c.gap("1")
    return c.gap("1") or ""


def test_health_lifts_a_cooldown_once_the_node_answers_again() -> None:
    """Issue 28: a "recovered" mark (for_s 0, from the health service) ends a cooldown at once;
    a zero-length mark without that reason, or for saturation, changes nothing."""
    from zmlcore.messages.node import RECOVERED

    t = _table("n1")
    m = Marks(t, "r1")
    assert m.apply_peer(NodeMark(router_id="r2", node_id="n1", kind="cooldown", for_s=30, reason="network"), 100.0)
    assert not m.apply_peer(NodeMark(router_id="health", node_id="n1", kind="cooldown", for_s=0), 101.0)
    assert not m.apply_peer(NodeMark(router_id="health", node_id="n1", kind="saturated", for_s=0,
                                     reason=RECOVERED), 101.0)
    assert t.views["n1"].cooldown_until == 130.0
    assert m.apply_peer(NodeMark(router_id="health", node_id="n1", kind="cooldown", for_s=0, reason=RECOVERED), 101.0)
    assert t.views["n1"].cooldown_until == 0.0 and m.describe("n1", 101.0) == {}
    # nothing to lift: no change
    assert not m.apply_peer(NodeMark(router_id="health", node_id="n1", kind="cooldown", for_s=0,
                                     reason=RECOVERED), 102.0)


def test_deadlines_follow_the_learned_speeds() -> None:
    """Issue 28: the inter-token deadline is a few expected gaps at the node's learned speeds
    (the 1 s floor for a fast node, up to the cap for a slow one), not a fixed 10 s; the
    per-state cache the router keeps computes the same as the pure function."""
    from zml_router.node.attempt import Learned, stall_timeout

    fast = NodeState(node_id="f", accelerator_type="cpu", family="CPU", endpoint="", prefill_tps=14_000,
                     decode_tps=500, max_concurrency=4)
    slow = NodeState(node_id="s", accelerator_type="cpu", family="CPU", endpoint="", prefill_tps=400,
                     decode_tps=10, max_concurrency=4)
    told = NodeState(node_id="t", accelerator_type="cpu", family="CPU", endpoint="", max_concurrency=4)
    for st in (fast, slow, told):
        for out in (0, 3, 9):
            assert Learned(st).stall_s(out, 1.0, 3.0, 10.0) == stall_timeout(st, out, 1.0, 3.0, 10.0)
    assert stall_timeout(fast, 3, 1.0, 3.0, 10.0) == 1.0
    assert stall_timeout(slow, 0, 1.0, 3.0, 10.0) == 10.0
    mid = stall_timeout(told, 0, 1.0, 3.0, 10.0)  # the type's 1,500 / 75: 3 x (13 ms + 1.37 s)
    assert 4.0 < mid < 4.3
    assert stall_timeout(fast, 0, 1.0, 0.0, 10.0) == 10.0  # factor 0: the fixed deadline
