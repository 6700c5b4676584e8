"""Skip reasons, error classification and routing_context, pinned nodes."""

from __future__ import annotations

import pytest
from test_policy_helpers import NOW, node

from zmlcore.config import PolicyConfig
from zmlcore.errors import BadRequestError, ModelNotLoadedError, NoHealthyNodesError, QueueFullError
from zmlcore.policy import FleetIndex, RouteRequest, RoutingState, builtin_policy, choose_node, is_routable
from zmlcore.policy.resolve import ResolvedPolicy

LAT = builtin_policy("latency")


def pick(nodes, req=RouteRequest(model="m"), pol=LAT, now=NOW):
    return choose_node(nodes, req, pol, now, RoutingState())


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"status": "down"}, "node_down"),
        ({"status": "loading"}, "node_loading"),
        ({"updated_at": NOW - 20}, "state_stale"),
        ({"models": (), "loading": ("m",)}, "model_loading"),
        ({"models": ("other",)}, "model_not_loaded"),
        ({"cooldown_until": NOW + 5}, "cooldown"),
        ({"saturated_until": NOW + 1}, "saturated"),
        ({}, None),
    ],
)
def test_is_routable_reasons(kw, reason):
    assert is_routable(node("n", **kw), "m", NOW, 15.0) == reason


@pytest.mark.parametrize(
    "kw", [{"status": "down"}, {"updated_at": NOW - 20}, {"cooldown_until": NOW + 5}, {"saturated_until": NOW + 1}]
)
def test_unroutable_nodes_are_skipped(kw):
    nodes = [node("bad", pending=0, **kw), node("good", pending=5, outstanding=5)]
    assert pick(nodes).node_id == "good"


def test_model_not_loaded_anywhere():
    with pytest.raises(ModelNotLoadedError) as ei:
        pick([node("h", models=("x",))])
    ctx = ei.value.routing_context
    assert ctx["final_error"] == "model_not_loaded" and ctx["policy"] == "latency"
    assert "recommendation" in ctx and ctx["evaluated"] == []


def test_model_still_loading():
    with pytest.raises(ModelNotLoadedError) as ei:
        pick([node("h", models=(), loading=("m",))])
    assert ei.value.routing_context["final_error"] == "model_loading"


def test_queue_full_when_all_saturated():
    nodes = [node("h1", saturated_until=NOW + 2), node("h2", saturated_until=NOW + 2), node("a", "nvidia_a100", cooldown_until=NOW + 9)]
    with pytest.raises(QueueFullError) as ei:
        pick(nodes)
    ctx = ei.value.routing_context
    assert ctx["final_error"] == "no_viable_node"
    assert ctx["recommendation"] == "increase fleet capacity or enable queue_on_saturation"
    assert ctx["evaluated"] == [
        {"family": "H100", "nodes_checked": 2, "rejected_reason": "all_nodes_over_capacity"},
        {"family": "A100", "nodes_checked": 1, "rejected_reason": "all_nodes_cooling_down"},
    ]


def test_no_healthy_nodes_context_shape():
    cfg = PolicyConfig(accelerator_chain=["H100", "MI300X"], cost_priority="balanced")
    pol = ResolvedPolicy("llama3-production", cfg, tuple(cfg.chain()))
    nodes = [node("h1", status="down"), node("h2", status="down"), node("m1", "amd_mi300x", updated_at=0)]
    with pytest.raises(NoHealthyNodesError) as ei:
        pick(nodes, pol=pol)
    ctx = ei.value.routing_context
    assert set(ctx) == {"policy", "evaluated", "final_error", "recommendation"}
    assert ctx["policy"] == "llama3-production"
    assert ctx["evaluated"] == [
        {"family": "H100", "nodes_checked": 2, "rejected_reason": "health_check_failed"},
        {"family": "MI300X", "nodes_checked": 1, "rejected_reason": "state_stale"},
    ]
    assert "routing_context=" in str(ei.value)


def test_chain_without_serving_nodes():
    pol = ResolvedPolicy("p", PolicyConfig(accelerator_chain=["Gaudi2"]), ("Gaudi2",))
    with pytest.raises(NoHealthyNodesError) as ei:
        pick([node("h")], pol=pol)
    assert ei.value.routing_context["final_error"] == "no_nodes_in_chain"


def test_health_threshold():
    pol = ResolvedPolicy("p", PolicyConfig(strategy="latency", health_threshold=50), ())
    nodes = [node("sick", health=10), node("ok", health=90, pending=3, outstanding=3)]
    assert pick(nodes, pol=pol).node_id == "ok"
    with pytest.raises(NoHealthyNodesError) as ei:
        pick([node("sick", health=10)], pol=pol)
    assert ei.value.routing_context["evaluated"][0]["rejected_reason"] == "health_score_below_threshold"


def test_exclude_skips_tried_nodes_and_index_is_restored():
    views = [node("h1"), node("h2", pending=2, outstanding=2)]
    fleet = FleetIndex(views)
    req = RouteRequest(model="m", exclude=frozenset({"h1"}))
    assert choose_node(fleet, req, LAT, NOW, RoutingState()).node_id == "h2"
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "h1"
    with pytest.raises(NoHealthyNodesError):
        choose_node(fleet, RouteRequest(model="m", exclude=frozenset({"h1", "h2"})), LAT, NOW, RoutingState())


def test_pinned_bypasses_policy():
    nodes = [node("fast"), node("slow", "aws_inferentia2", outstanding=30)]
    d = pick(nodes, RouteRequest(model="m", accelerator_id="slow"))
    assert (d.node_id, d.policy, d.queue_depth) == ("slow", "pinned", 30)


@pytest.mark.parametrize(
    ("kw", "exc"),
    [({"status": "down"}, NoHealthyNodesError), ({"saturated_until": NOW + 1}, QueueFullError),
     ({"models": (), "loading": ("m",)}, ModelNotLoadedError)],
)
def test_pinned_errors(kw, exc):
    with pytest.raises(exc) as ei:
        pick([node("p", **kw)], RouteRequest(model="m", accelerator_id="p"))
    assert ei.value.routing_context["policy"] == "pinned"


def test_pinned_unknown_node():
    # The caller named a node that does not exist: their mistake, never worth a retry.
    with pytest.raises(BadRequestError):
        pick([node("p")], RouteRequest(model="m", accelerator_id="nope"))
