"""Batch priority's headroom rule (zmlcore.policy.headroom): pure, no server."""

from __future__ import annotations

import pytest

from zmlcore.errors import NoHealthyNodesError, QueueFullError
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState
from zmlcore.policy.headroom import admit_batch, has_headroom, reserved_slots
from zmlcore.config import PolicyConfig
from zmlcore.policy.resolve import make_policy

NOW = 1000.0
#: What the runners send: the cheapest capacity within a relaxed target.
COST = make_policy("batch", PolicyConfig(strategy="cost", latency_target_ms=10_000), ["MI300X", "H100"])


def node(node_id: str, acc: str, family: str, *, out: int = 0, pending: int = 0, maxc: int = 8,
         status: str = "up", price: float = 1.0) -> NodeView:
    st = NodeState(node_id=node_id, accelerator_type=acc, family=family, endpoint=f"http://{node_id}", status=status,
                   models=["m"], max_concurrency=maxc, updated_at=NOW, cost_per_hour=price)
    return NodeView(st, outstanding=out, pending=pending)


def decide(nodes: list[NodeView], **rr: object) -> str:
    return admit_batch(nodes, RouteRequest(model="m", **rr), COST, NOW, RoutingState(), stale_after_s=15.0,  # type: ignore[arg-type]
                       reserve=0.25).node_id


def test_reserve_is_a_share_of_the_slots_at_least_one() -> None:
    assert reserved_slots(32, 0.25) == 8 and reserved_slots(16, 0.25) == 4 and reserved_slots(2, 0.25) == 1
    assert reserved_slots(32, 0.0) == 0


def test_a_node_whose_reserve_is_reached_has_no_headroom() -> None:
    assert has_headroom(node("a", "amd_mi300x", "MI300X", out=5), 0.25)  # 5 + 1 + 2 <= 8
    assert not has_headroom(node("a", "amd_mi300x", "MI300X", out=6), 0.25)  # 6 + 1 + 2 > 8
    assert has_headroom(node("a", "amd_mi300x", "MI300X", out=5, pending=5), 0.25)  # prefill: the estimate's
    assert has_headroom(node("a", "amd_mi300x", "MI300X", out=7), 0.0)


def test_the_cheapest_node_with_headroom_gets_it() -> None:
    cheap = node("mi", "amd_mi300x", "MI300X", price=0.5)
    dear = node("h", "nvidia_h100", "H100", price=9.0)
    assert decide([cheap, dear]) == "mi"
    cheap.outstanding = 6  # its reserve is reached: the batch line goes to the dearer node
    assert decide([cheap, dear]) == "h"
    cheap.outstanding, cheap.pending = 3, 3  # prefills waiting: still the cheap one (within the target)
    assert decide([cheap, dear]) == "mi"


def test_no_headroom_anywhere_is_queue_full_with_a_short_retry() -> None:
    nodes = [node("mi", "amd_mi300x", "MI300X", out=6), node("h", "nvidia_h100", "H100", out=7)]
    with pytest.raises(QueueFullError) as err:
        decide(nodes)
    assert err.value.retry_after == pytest.approx(0.2)
    assert err.value.routing_context is not None and err.value.routing_context["final_error"] == "no_headroom"
    # a pinned node without headroom: the same (it is busy, not broken)
    with pytest.raises(QueueFullError):
        decide(nodes, accelerator_id="mi")


def test_nodes_down_are_not_a_matter_of_headroom() -> None:
    with pytest.raises(NoHealthyNodesError):
        decide([node("mi", "amd_mi300x", "MI300X", status="down", out=7)])
