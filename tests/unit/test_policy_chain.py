"""Policy chains: accelerator_chain / accelerator_preference with each cost_priority."""

from __future__ import annotations

from test_policy_helpers import NOW, fleet5, node

from zmlcore.config import PolicyConfig, PreferenceEntry
from zmlcore.policy import FleetIndex, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.resolve import ResolvedPolicy

REQ = RouteRequest(model="m", prompt_tokens=1000)


def chain(prio: str | None, fams: list[str], target: float | None = 500, **kw) -> ResolvedPolicy:
    cfg = PolicyConfig(accelerator_chain=fams, cost_priority=prio, latency_target_ms=target, **kw)  # type: ignore[arg-type]
    return ResolvedPolicy("p", cfg, tuple(cfg.chain()))


def pick(nodes, pol, req=REQ):
    return choose_node(nodes, req, pol, NOW, RoutingState())


def test_latency_priority_takes_first_family_within_target_even_if_slower():
    # A100 is first in the chain; idle, 1000/5500 = 0.18 s < 0.5 s: taken although H100 is faster.
    d = pick(fleet5(), chain("latency", ["A100", "H100"]))
    assert d.node_id == "a100"
    assert [e.family for e in d.evaluated] == ["A100", "H100"]


def test_latency_priority_moves_on_when_first_family_over_target():
    nodes = fleet5()
    nodes[1] = node("a100", "nvidia_a100", pending=4, outstanding=4)  # ~0.77 s
    d = pick(nodes, chain("latency", ["A100", "H100"]))
    assert d.node_id == "h100"
    assert d.evaluated[0].rejected_reason == "latency_target_exceeded"


def test_latency_priority_falls_back_to_best_estimate():
    nodes = [node("a", "nvidia_a100", pending=10, outstanding=10), node("h", pending=6, outstanding=6)]
    d = pick(nodes, chain("latency", ["A100", "H100"]))
    assert d.node_id == "h"


def test_chain_restricts_families():
    d = pick(fleet5(), chain("latency", ["Gaudi2"]))
    assert d.node_id == "gaudi2"


def test_cost_priority_cheapest_within_full_target():
    nodes = fleet5()
    nodes[2] = node("mi300x", "amd_mi300x", pending=3, outstanding=3)  # ~0.38 s: within 0.5 s
    d = pick(nodes, chain("cost", ["H100", "MI300X", "Inferentia2"]), RouteRequest(model="m", prompt_tokens=300))
    assert d.node_id == "mi300x"


def test_cost_priority_considers_next_option_when_cheapest_over_target():
    nodes = fleet5()
    nodes[2] = node("mi300x", "amd_mi300x", pending=6, outstanding=6)  # ~0.6 s > 0.5
    d = pick(nodes, chain("cost", ["H100", "MI300X"]), RouteRequest(model="m", prompt_tokens=300))
    assert d.node_id == "h100"  # dearer, but within target


def test_cost_priority_target_weighting_from_latency_target():
    nodes = fleet5()
    nodes[2] = node("mi300x", "amd_mi300x", pending=6, outstanding=6)
    d = pick(nodes, chain("cost", ["H100", "MI300X"], target=2000), RouteRequest(model="m", prompt_tokens=300))
    assert d.node_id == "mi300x"


def test_balanced_prefers_cheap_when_both_fast():
    d = pick(fleet5(), chain("balanced", ["H100", "MI300X"]), RouteRequest(model="m", prompt_tokens=100))
    assert d.node_id == "mi300x"


def test_balanced_prefers_fast_when_cheap_is_slow():
    nodes = fleet5()
    nodes[2] = node("mi300x", "amd_mi300x", pending=2, outstanding=2)  # 0.29 s > 0.25
    d = pick(nodes, chain("balanced", ["H100", "MI300X"]), RouteRequest(model="m", prompt_tokens=100))
    assert d.node_id == "h100"


def test_accelerator_preference_priorities_order_the_chain():
    cfg = PolicyConfig(
        accelerator_preference=[PreferenceEntry(family="H100", priority=2), PreferenceEntry(family="Gaudi2", priority=1)],
        cost_priority="latency", latency_target_ms=2000,
    )
    pol = ResolvedPolicy("pref", cfg, tuple(cfg.chain()))
    assert pol.chain == ("Gaudi2", "H100")
    assert pick(fleet5(), pol).node_id == "gaudi2"


def test_default_balanced_covers_every_family_in_registration_order():
    d = pick(fleet5(), builtin_policy("balanced"))
    assert [e.family for e in d.evaluated] == ["H100", "A100", "MI300X", "Gaudi2", "Inferentia2"]
    assert all(e.nodes_checked == 1 for e in d.evaluated)


def test_family_aliases_in_chain():
    d = pick(fleet5(), chain("latency", ["inf2"]))
    assert d.node_id == "inf2"


def test_chain_family_without_nodes_reported():
    nodes = [node("h")]
    d = pick(nodes, chain("latency", ["MI300X", "H100"]))
    assert d.node_id == "h"
    assert d.evaluated[0].as_dict() == {"family": "MI300X", "nodes_checked": 0, "rejected_reason": "no_nodes"}


def test_a_rejection_stays_with_its_decision_on_a_large_table():
    """Over a large table the evaluation's entries are cached per table and shared between
    decisions (VCtx.evaluate): a strategy's rejection must reach only its own decision."""
    views = [node(f"a{i}", "nvidia_a100", pending=4, outstanding=4) for i in range(20)]
    views += [node(f"h{i}", "nvidia_h100") for i in range(20)]
    fleet, pol, state = FleetIndex(views), chain("latency", ["A100", "H100"]), RoutingState()
    first = choose_node(fleet, REQ, pol, NOW, state)
    assert first.node_id.startswith("h") and first.evaluated[0].rejected_reason == "latency_target_exceeded"
    for v in views[:20]:
        v.set_counts(0, 0)
    second = choose_node(fleet, REQ, pol, NOW, state)
    assert second.node_id.startswith("a")
    assert [e.rejected_reason for e in second.evaluated] == [None, None]
    assert first.evaluated[0].rejected_reason == "latency_target_exceeded"
    third = choose_node(fleet, REQ, pol, NOW, state)  # the cached entries, untouched
    assert [e.as_dict() for e in third.evaluated] == [e.as_dict() for e in second.evaluated]
