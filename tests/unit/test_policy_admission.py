"""zmlcore.policy.admit: choose_node under the admission bound, with a half-open breaker (pure:
no router, no network; the router calls it on its node table)."""

from __future__ import annotations

import pytest

from zmlcore.errors import QueueFullError, ZMLError
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, NodeView, RouteRequest, RoutingState, admit
from zmlcore.policy.resolve import builtin_policy

NOW = 1_000.0


def _fleet() -> list[NodeView]:
    return [NodeView(NodeState(node_id=node_id, accelerator_type=acc, family=fam, endpoint="http://x", status="up",
                               models=["m"], updated_at=NOW))
            for node_id, acc, fam in (("h1", "nvidia_h100", "H100"), ("g1", "intel_gaudi2", "Gaudi2"))]


def _admit(nodes: list[NodeView], rr: RouteRequest, policy: str = "latency", bound: float = 30.0,
           state: RoutingState | None = None) -> Decision:
    return admit(nodes, rr, builtin_policy(policy), NOW, state or RoutingState(), stale_after_s=15.0,
                 ttft_bound_s=bound)


def _view(nodes: list[NodeView], node_id: str) -> NodeView:
    return next(v for v in nodes if v.node_id == node_id)


def test_under_the_bound_the_policy_decides() -> None:
    d = _admit(_fleet(), RouteRequest(model="m", prompt_tokens=2000))
    assert d.node_id == "h1" and d.estimated_ttft_s < 1


def test_a_policy_pick_over_the_bound_falls_back_to_the_fastest_node() -> None:
    nodes, state = _fleet(), RoutingState()
    _view(nodes, "g1").set_counts(40, 0)  # the round-robin pick may be the overloaded Gaudi2
    picks = {_admit(nodes, RouteRequest(model="m"), "round_robin", 2.0, state).node_id for _ in range(4)}
    assert picks == {"h1"}


def test_every_node_over_the_bound_is_queue_full_with_context() -> None:
    nodes = _fleet()
    for v in nodes:
        v.set_counts(200, 0)
    with pytest.raises(QueueFullError) as info:
        _admit(nodes, RouteRequest(model="m"), bound=2.0)
    ctx = info.value.routing_context
    assert ctx is not None and ctx["final_error"] == "all_nodes_over_capacity"
    assert ctx["best_estimated_ttft_s"] > 2.0 and "queue_on_saturation" in ctx["recommendation"]


def test_pinned_requests_bypass_the_bound() -> None:
    nodes = _fleet()
    _view(nodes, "h1").set_counts(200, 0)
    assert _admit(nodes, RouteRequest(model="m", accelerator_id="h1"), bound=2.0).node_id == "h1"


def test_when_every_node_cools_down_the_soonest_gets_one_more_chance() -> None:
    nodes = _fleet()
    _view(nodes, "h1").cooldown_until = NOW + 30
    _view(nodes, "g1").cooldown_until = NOW + 10
    assert _admit(nodes, RouteRequest(model="m")).node_id == "g1"  # half-open: its cooldown ends first
    assert _view(nodes, "h1").cooldown_until > NOW  # the other stays out
    assert _view(nodes, "g1").cooldown_until == 0.0  # the probe's own mark is cleared, nothing else


def test_an_excluded_or_unpinned_cooling_node_is_not_probed() -> None:
    nodes = _fleet()
    for v in nodes:
        v.cooldown_until = NOW + 30
    with pytest.raises(ZMLError):  # h1 tried already, g1 not the pinned node: nothing to probe
        _admit(nodes, RouteRequest(model="m", accelerator_id="h1", exclude=frozenset({"h1"})))
    assert all(v.cooldown_until == NOW + 30 for v in nodes)


def test_a_node_that_is_merely_down_is_not_resurrected() -> None:
    nodes = [NodeView(NodeState(node_id=n, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                                status="down", models=["m"], updated_at=NOW)) for n in ("a", "b")]
    with pytest.raises(ZMLError) as info:
        _admit(nodes, RouteRequest(model="m"))
    assert info.value.code == "NO_HEALTHY_NODES"
