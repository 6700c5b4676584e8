"""The TTFT estimate, NodeView counters and FleetIndex upkeep."""

from __future__ import annotations

import pytest
from test_policy_helpers import NOW, node

from zmlcore.policy import FleetIndex, RouteRequest, RoutingState, builtin_policy, choose_node, estimate_ttft
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, Coeffs
from zmlcore.fleet.perfmodel import SimProfile

LAT = builtin_policy("latency")


def test_estimate_matches_reference_formula():
    prof = SimProfile.for_type("amd_mi300x")
    st = node("m", "amd_mi300x", running=0).state
    pend, out, P = 3, 40, 700
    c = prof.max_concurrency
    expect = (pend * MEAN_PROMPT_TOKENS + P) / prof.prefill_tps + max(0, out + 1 - c) * (MEAN_OUTPUT_TOKENS - 1) / (c * prof.decode_rate(c))
    assert estimate_ttft(st, out, pend, P) == pytest.approx(expect)


def test_capacity_matches_sim_profile():
    for t in ("nvidia_h100", "nvidia_a100", "amd_mi300x", "intel_gaudi2", "aws_inferentia2"):
        p = SimProfile.for_type(t)
        c = Coeffs(p.prefill_tps, p.decode_tps, p.max_concurrency, p.cost_per_hour)
        assert c.mu == pytest.approx(p.capacity_rps(MEAN_PROMPT_TOKENS, MEAN_OUTPUT_TOKENS))


def test_effective_counts_combine_poll_and_local():
    v = node("n", running=10, waiting=2)  # the poll saw 12, 2 waiting; we had sent none
    assert v.effective_outstanding() == 12 and v.effective_pending() == 2
    v.outstanding += 3
    v.pending += 3
    assert v.effective_outstanding() == 15 and v.effective_pending() == 5
    st = v.state
    v.state = st  # a new poll that counts our 3: nothing external beyond them
    assert v.out_at_poll == 3
    assert v.effective_outstanding() == 3 + (12 - 3)


def test_index_follows_counter_changes():
    views = [node("a"), node("b")]
    fleet = FleetIndex(views)
    s = RoutingState()
    first = choose_node(fleet, RouteRequest(model="m"), LAT, NOW, s).node_id
    fleet.get(first).pending += 1
    fleet.get(first).outstanding += 1
    second = choose_node(fleet, RouteRequest(model="m"), LAT, NOW, s).node_id
    assert {first, second} == {"a", "b"}


def test_index_cooldown_blocks_then_releases():
    views = [node("a"), node("b", pending=2, outstanding=2)]
    fleet = FleetIndex(views)
    views[0].cooldown_until = NOW + 30
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "b"
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW + 31, RoutingState(), stale_after_s=60).node_id == "a"


def test_index_stale_until_new_state():
    views = [node("a"), node("b", pending=2, outstanding=2, updated_at=NOW + 100)]
    fleet = FleetIndex(views)
    later = NOW + 20
    assert choose_node(fleet, RouteRequest(model="m"), LAT, later, RoutingState()).node_id == "b"
    st = views[0].state
    views[0].state = type(st)(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "updated_at": later})
    assert choose_node(fleet, RouteRequest(model="m"), LAT, later, RoutingState()).node_id == "a"


def test_index_reindexes_when_models_change():
    views = [node("a", models=("x",)), node("b")]
    fleet = FleetIndex(views)
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "b"
    views[1].pending = 5
    views[1].outstanding = 5
    st = views[0].state
    views[0].state = type(st)(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "models": ["x", "m"]})
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "a"


def test_index_status_change_without_reindex():
    views = [node("a"), node("b", pending=5, outstanding=5)]
    fleet = FleetIndex(views)
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "a"
    st = views[0].state
    views[0].state = type(st)(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "status": "down"})
    assert choose_node(fleet, RouteRequest(model="m"), LAT, NOW, RoutingState()).node_id == "b"


def test_index_is_a_sequence_and_close_unhooks():
    views = [node("a"), node("b")]
    fleet = FleetIndex(views)
    assert len(fleet) == 2 and fleet[0] is views[0] and list(fleet) == views and fleet.get("zz") is None
    fleet.close()
    assert views[0]._watchers == []


def test_measured_speeds_update_rows_in_place_without_rebuild():
    a, b = node("a"), node("b")
    fleet = FleetIndex([a, b])
    t = fleet.table("m")
    builds = fleet.rebuilds
    for v, pf in ((a, 10_000.0), (b, 20_050.0)):
        st = v.state
        v.state = type(st)(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "prefill_tps": pf})
    assert fleet.table("m") is t and fleet.rebuilds == builds
    assert list(t.inv_pf) == [1 / 10_000.0, 1 / 20_050.0]
    assert choose_node(fleet, RouteRequest(model="m", prompt_tokens=2000), LAT, NOW, RoutingState()).node_id == "b"


def test_rows_stay_exact_under_random_updates():
    import random

    from zmlcore.policy.estimate import INF, node_cost, node_speeds

    rng = random.Random(3)
    views = [node(f"n{i}", outstanding=rng.randint(0, 40), pending=rng.randint(0, 3)) for i in range(30)]
    fleet = FleetIndex(views)
    t = fleet.table("m")
    for _ in range(2000):
        v = views[rng.randrange(30)]
        r = rng.random()
        if r < 0.3:
            v.outstanding = max(0, v.outstanding + rng.choice((-1, 1)))
        elif r < 0.55:
            v.pending = max(0, v.pending + rng.choice((-1, 1)))
        elif r < 0.8:  # the router's in-flight refresh: both at once, one index update
            v.set_counts(max(0, v.outstanding + rng.choice((-1, 0, 1))), max(0, v.pending + rng.choice((-1, 0, 1))))
        else:
            st = v.state
            v.state = type(st)(**{**{f: getattr(st, f) for f in st.__struct_fields__},
                                  "prefill_tps": rng.uniform(8000, 12000), "decode_tps": rng.uniform(60, 90),
                                  "queue_running": rng.randint(0, 30), "status": rng.choice(("up", "up", "down"))})
        if rng.random() < 0.3:
            for j, w in enumerate(t.views):
                c = Coeffs(*node_speeds(w.state), node_cost(w.state))
                up = w.state.status == "up"
                assert t.key[j] == (c.load_key(w.effective_outstanding(), w.effective_pending()) if up else INF)
                assert t.drain[j] == (c.drain_key(w.effective_outstanding()) if up else INF)
                assert t.inv_pf[j] == c.inv_pf and t.cost_cap[j] == c.cost_cap
    assert fleet.table("m") is t


def test_reused_plain_list_gets_a_cached_watching_index():
    views = [node("a"), node("b")]
    state = RoutingState()
    choose_node(views, RouteRequest(model="m"), LAT, NOW, state)
    assert state.fleet is None  # first sight: throw-away index
    first = choose_node(views, RouteRequest(model="m"), LAT, NOW, state).node_id
    idx = state.fleet
    assert isinstance(idx, FleetIndex) and views[0]._watchers == [idx]
    v = idx.get(first)
    v.pending += 1
    v.outstanding += 1
    assert choose_node(views, RouteRequest(model="m"), LAT, NOW, state).node_id != first
    assert state.fleet is idx
    new_list = [*views, node("c")]
    choose_node(new_list, RouteRequest(model="m"), LAT, NOW, state)
    choose_node(new_list, RouteRequest(model="m"), LAT, NOW, state)
    assert state.fleet is not idx and views[0]._watchers == [state.fleet]



def test_the_tables_bounds_hold_and_let_no_stale_blocked_or_unhealthy_row_through(monkeypatch):
    """A large table keeps bounds on its columns' extremes instead of reading them per
    decision: they must hold after every write, and a row that turns stale, cools down or
    drops below the health threshold right after a decision made the bounds exact must be
    left out at once (and taken back when it recovers)."""
    import msgspec

    from zmlcore.config import PolicyConfig
    from zmlcore.policy import fleet as fleet_module
    from zmlcore.policy.resolve import ResolvedPolicy

    monkeypatch.setattr(fleet_module, "SMALL_TABLE", 0)
    views = [node(f"h{i}", outstanding=i) for i in range(6)]  # h0 is the fastest
    fleet = FleetIndex(views)
    healthy = ResolvedPolicy("h", PolicyConfig(health_threshold=50.0), ())
    t = fleet.table("m")

    def pick(now, pol=LAT):
        d = choose_node(fleet, RouteRequest(model="m"), pol, now, RoutingState(), stale_after_s=15.0)
        assert t.upd_lo <= t.updated.min() and t.blk_hi >= t.blocked.max() and t.health_lo <= t.health.min()
        return d.node_id

    assert pick(NOW) == "h0" and pick(NOW, healthy) == "h0"
    views[0].cooldown_until = NOW + 1
    assert pick(NOW) == "h1"
    views[0].cooldown_until = 0.0
    assert pick(NOW) == "h0"
    views[0].state = msgspec.structs.replace(views[0].state, health_score=10.0)
    assert pick(NOW, healthy) == "h1" and pick(NOW) == "h0"
    views[0].state = msgspec.structs.replace(views[0].state, health_score=100.0)
    for v in views[1:]:
        v.state = msgspec.structs.replace(v.state, updated_at=NOW + 10)
    assert pick(NOW + 10) == "h0"
    assert pick(NOW + 16) == "h1"  # h0's state is 16 s old: stale, the others 6 s
    views[0].state = msgspec.structs.replace(views[0].state, updated_at=NOW + 16)
    assert pick(NOW + 16) == "h0"


def _cpu(node_id: str, *, slowdown: float = 0.0, full_decode_s: float = 0.0):
    """A one-thread llama-server as health publishes it: learned speeds for model m, 4 slots."""
    import msgspec

    from zmlcore.messages.speeds import ModelSpeeds

    v = node(node_id, "cpu")
    ms = ModelSpeeds(prefill_tps=30_000, decode_tps=600, decode_slowdown=slowdown, prefill_sigma=0.05,
                     decode_sigma=0.05, source="measured", full_decode_s=full_decode_s)
    v.state = msgspec.structs.replace(v.state, max_concurrency=4, model_speeds={"m": ms})
    return v


def test_a_full_nodes_slot_wait_takes_its_learned_decode():
    # One CPU thread: per-sequence decode falls ~2.5x from 1 to 4 sequences (k ~0.5), a GPU's
    # 2% per sequence is not it; and what a full node's requests took past their first token,
    # learned, is the slot wait itself (answers' length, paused decodes, a shared CPU).
    out, P = 7, 100  # 4 slots taken, 3 waiting: this request is the 4th to wait
    gpu_k = estimate_ttft(_cpu("a").state, out, 0, P, model="m", explore=False)
    cpu_k = estimate_ttft(_cpu("a", slowdown=0.5).state, out, 0, P, model="m", explore=False)
    step = lambda k: (MEAN_OUTPUT_TOKENS - 1) * (1 + k * 3) / 600 / 4  # noqa: E731
    assert cpu_k - gpu_k == pytest.approx(4 * (step(0.5) - step(0.02)))
    full = estimate_ttft(_cpu("a", slowdown=0.5, full_decode_s=0.6).state, out, 0, P, model="m", explore=False)
    assert full == pytest.approx(P / 30_000 + 4 * 0.6 / 4)
    # the index ranks on the same figures: a node whose full slots free slowly loses to a warm-up
    # equal one whose free fast, though both hold the same queue
    slow, quick = _cpu("slow", full_decode_s=0.6), _cpu("quick", full_decode_s=0.1)
    for v in (slow, quick):
        v.outstanding = out
    fleet = FleetIndex([slow, quick])
    assert choose_node(fleet, RouteRequest(model="m", prompt_tokens=P), LAT, NOW, RoutingState()).node_id == "quick"
