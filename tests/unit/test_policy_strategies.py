"""Each strategy's choice, on small fleets where the right answer is computable by hand."""

from __future__ import annotations

import pytest
from test_policy_helpers import NOW, fleet5, node

from zmlcore.config import PolicyConfig
from zmlcore.policy import FleetIndex, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.resolve import ResolvedPolicy

REQ = RouteRequest(model="m", prompt_tokens=1000)


def pick(nodes, pol, req=REQ, state=None, now=NOW):
    return choose_node(nodes, req, pol, now, state or RoutingState())


def weighted(**kw) -> ResolvedPolicy:
    return ResolvedPolicy("w", PolicyConfig(strategy="weighted", **kw), ())


# --- latency ---

def test_latency_idle_fleet_picks_fastest_prefill():
    # 2,000 tokens: 200 ms on the H100, above the near-tie window's 100 ms gate.
    d = pick(fleet5(), builtin_policy("latency"), RouteRequest(model="m", prompt_tokens=2000))
    assert d.node_id == "h100"
    assert d.estimated_ttft_s == pytest.approx(2000 / 10_000)
    assert d.policy == "latency"


def test_latency_near_tie_goes_to_the_slowest_prefill():
    # 250 tokens: H100 25 ms, MI300X 28 ms, A100 45 ms, Gaudi2 50 ms, Inf2 83 ms. Within
    # 30 ms of the best: all but the Inf2 -> the slowest prefill of those, the Gaudi2.
    d = pick(fleet5(), builtin_policy("latency"), RouteRequest(model="m", prompt_tokens=250))
    assert d.node_id == "gaudi2"
    assert d.estimated_ttft_s == pytest.approx(250 / 5_000)


def test_latency_near_tie_window_is_bounded():
    from zmlcore.policy.strategies import latency

    # The window only applies while the best estimate is under TIE_BELOW_S; past it the
    # lowest estimate wins.
    assert latency.TIE_S > 0 and latency.TIE_BELOW_S > latency.TIE_S
    p = int(latency.TIE_BELOW_S * 10_000) + 500  # H100's estimate just above the gate
    d = pick(fleet5(), builtin_policy("latency"), RouteRequest(model="m", prompt_tokens=p))
    assert d.node_id == "h100"


def test_latency_prefers_node_with_shorter_prefill_backlog():
    nodes = [node("h1", pending=3, outstanding=3), node("h2", pending=1, outstanding=1)]
    assert pick(nodes, builtin_policy("latency")).node_id == "h2"


def test_latency_counts_slot_wait_when_full():
    # h1 full (32 running, nothing pending): waits for a slot; MI300X idle is faster.
    nodes = [node("h1", running=32), node("mi", "amd_mi300x")]
    d = pick(nodes, builtin_policy("latency"))
    assert d.node_id == "mi"
    assert d.estimated_ttft_s == pytest.approx(1000 / 9000)


def test_latency_uses_local_counters_beyond_poll():
    # The poll saw 0; the router since dispatched 5 pending requests to h1.
    nodes = [node("h1", outstanding=5, pending=5), node("h2", outstanding=0)]
    assert pick(nodes, builtin_policy("latency")).node_id == "h2"


def test_latency_queue_depth_in_decision():
    nodes = [node("h1", running=4, waiting=0, outstanding=0)]
    assert pick(nodes, builtin_policy("latency")).queue_depth == 4


# --- cost ---

def test_cost_picks_cheapest_per_capacity_when_idle():
    # $/h per req/s of capacity: MI300X 1.04 < Inf2 1.20 < H100 1.25 < Gaudi2 1.35 < A100 1.64
    assert pick(fleet5(), builtin_policy("cost")).node_id == "mi300x"


def test_cost_skips_cheap_node_over_half_the_target():
    nodes = fleet5()
    nodes[2] = node("mi300x", "amd_mi300x", pending=3, outstanding=3)  # ~0.38 s > 0.25 s
    d = pick(nodes, builtin_policy("cost"), RouteRequest(model="m", prompt_tokens=300))
    assert d.node_id == "inf2"  # next cheapest, 300/3000 = 0.1 s


def test_cost_falls_back_to_fastest_when_nothing_within_threshold():
    nodes = [node("mi", "amd_mi300x", pending=10, outstanding=10), node("h", pending=8, outstanding=8)]
    assert pick(nodes, builtin_policy("cost")).node_id == "h"


def test_cost_respects_queue_threshold():
    pol = ResolvedPolicy("c", PolicyConfig(strategy="cost", queue_threshold=2), ())
    nodes = [node("mi", "amd_mi300x", running=3), node("h", running=1)]
    assert pick(nodes, pol).node_id == "h"


def test_cost_uses_polled_price():
    nodes = [node("mi", "amd_mi300x", cost=30.0), node("h")]
    assert pick(nodes, builtin_policy("cost")).node_id == "h"


# --- availability ---

def test_availability_spreads_by_capacity():
    # (out+1)/mu: H100 with 3 -> 4/3.2=1.25; Inf2 idle -> 1/0.66=1.5; so H100 still wins
    nodes = [node("h", outstanding=3), node("i", "aws_inferentia2")]
    assert pick(nodes, builtin_policy("availability")).node_id == "h"
    nodes = [node("h", outstanding=5), node("i", "aws_inferentia2")]
    assert pick(nodes, builtin_policy("availability")).node_id == "i"


# --- round robin ---

def test_round_robin_cycles_over_healthy_nodes_ignoring_load():
    nodes = [node("a", outstanding=50), node("b", status="down"), node("c"), node("d", "amd_mi300x")]
    state = RoutingState()
    got = [pick(nodes, builtin_policy("round_robin"), state=state).node_id for _ in range(6)]
    assert got == ["a", "c", "d", "a", "c", "d"]


# --- weighted ---

def test_weighted_latency_only_equals_latency():
    nodes = fleet5()  # (a long prompt: no near-tie, which only `latency` applies)
    req = RouteRequest(model="m", prompt_tokens=2000)
    assert pick(nodes, weighted(latency_weight=1.0), req).node_id == pick(nodes, builtin_policy("latency"), req).node_id


def test_weighted_cost_only_picks_cheapest():
    assert pick(fleet5(), weighted(cost_weight=1.0)).node_id == "mi300x"


def test_weighted_mix():
    d = pick(fleet5(), weighted(latency_weight=0.6, cost_weight=0.4))
    assert d.node_id in ("h100", "mi300x")
    d = pick(fleet5(), weighted(latency_weight=0.05, cost_weight=0.95))
    assert d.node_id == "mi300x"


def test_weighted_queue_threshold_and_fallback():
    nodes = [node("mi", "amd_mi300x", running=10), node("h", running=2)]
    assert pick(nodes, weighted(cost_weight=1.0, queue_threshold=8)).node_id == "h"
    # every node above the threshold: latency fallback
    nodes = [node("mi", "amd_mi300x", running=10, outstanding=0), node("h", running=9)]
    d = pick(nodes, weighted(cost_weight=1.0, queue_threshold=8))
    assert d.node_id == "h" and d.estimated_ttft_s == pytest.approx(1000 / 10_000)  # the lowest estimate


# --- determinism and index equivalence ---

@pytest.mark.parametrize("name", ["latency", "cost", "availability", "balanced", "round_robin"])
def test_deterministic_and_index_matches_list(name):
    import random

    rng = random.Random(7)
    accels = ["nvidia_h100", "nvidia_a100", "amd_mi300x", "intel_gaudi2", "aws_inferentia2"]
    views = [node(f"n{i}", accels[i % 5], outstanding=rng.randint(0, 40), pending=rng.randint(0, 4)) for i in range(25)]
    fleet = FleetIndex(views)
    s1, s2 = RoutingState(), RoutingState()
    pol = builtin_policy(name)
    for k in range(100):
        req = RouteRequest(model="m", prompt_tokens=rng.randint(20, 4000))
        a = choose_node(views, req, pol, NOW, s1)
        b = choose_node(fleet, req, pol, NOW, s2)
        assert (a.node_id, a.estimated_ttft_s) == (b.node_id, b.estimated_ttft_s)
        v = fleet.get(a.node_id)
        v.outstanding += 1
        v.pending += 1
        w = views[k % 25]
        w.outstanding = max(0, w.outstanding - 1)
        w.pending = max(0, w.pending - 1)
