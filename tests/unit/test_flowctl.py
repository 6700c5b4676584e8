"""zmlcore.flowctl: priority bands, token-fair shares across replicas, SLO admission and the
saturation queue's order (pure: no router, no network)."""

from __future__ import annotations

import math
import random

import pytest

from zmlcore import subjects
from zmlcore.config import FlowConfig, ModelConfig
from zmlcore.errors import BadRequestError, QueueFullError, SloUnattainableError
from zmlcore.flowctl import (BATCH, CRITICAL, SHEDDABLE, STANDARD, ShareBook, Slo, Waiting, admit_slo, ask_of,
                             claim, displaced, effective_band, pick, ranked, predict_tpot, queue_budget_s, tpot_at)
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState
from zmlcore.policy.resolve import builtin_policy

NOW = 1_000.0


# --- bands ------------------------------------------------------------------------------------
def test_a_claim_above_the_ceiling_is_lowered_and_says_so() -> None:
    assert claim("critical", default=STANDARD, ceiling=STANDARD) == (STANDARD, True)
    assert claim("critical", default=STANDARD, ceiling=CRITICAL) == (CRITICAL, False)


def test_a_claim_below_the_ceiling_is_kept() -> None:
    assert claim("sheddable", default=STANDARD, ceiling=CRITICAL) == (SHEDDABLE, False)
    assert claim("BATCH", default=STANDARD, ceiling=STANDARD) == (BATCH, False)


def test_no_claim_takes_the_default_bounded_by_the_ceiling() -> None:
    assert claim(None, default=SHEDDABLE, ceiling=CRITICAL) == (SHEDDABLE, False)
    assert claim("", default=CRITICAL, ceiling=STANDARD) == (STANDARD, False)


def test_an_unknown_band_is_a_bad_request_naming_the_bands() -> None:
    with pytest.raises(BadRequestError, match="critical, standard, sheddable, batch"):
        claim("urgent", default=STANDARD, ceiling=CRITICAL)


# --- what a request asks ----------------------------------------------------------------------
def test_ask_reads_band_and_targets_from_headers() -> None:
    h = {subjects.H_PRIORITY: "sheddable", subjects.H_TTFT_SLO_MS: "500", subjects.H_TPOT_SLO_MS: "40"}
    a = ask_of(h, tenant="t", flow=FlowConfig(), model=None)
    assert (a.band, a.lowered, a.slo) == (SHEDDABLE, False, Slo(0.5, 0.04)) and not a.plain


def test_ask_key_ceiling_and_default_come_from_front_door_headers() -> None:
    h = {subjects.H_PRIORITY: "critical", subjects.H_PRIORITY_MAX: "critical", subjects.H_TENANT_WEIGHT: "3"}
    a = ask_of(h, tenant="t", flow=FlowConfig(), model=None)
    assert (a.band, a.lowered, a.weight) == (CRITICAL, False, 3.0)
    a = ask_of({subjects.H_PRIORITY: "critical"}, tenant="t", flow=FlowConfig(), model=None)
    assert (a.band, a.lowered) == (STANDARD, True)  # [flow] max_priority = standard


def test_ask_defaults_request_over_model_over_flow() -> None:
    flow = FlowConfig(ttft_slo_ms=2000, default_priority="sheddable")
    model = ModelConfig(ttft_slo_ms=800, priority="standard")
    assert ask_of({}, tenant="t", flow=flow, model=model).slo == Slo(0.8, None)
    assert ask_of({}, tenant="t", flow=flow, model=None).slo == Slo(2.0, None)
    assert ask_of({}, tenant="t", flow=flow, model=None).band == SHEDDABLE
    assert ask_of({}, tenant="t", flow=flow, model=model).band == STANDARD
    assert ask_of({subjects.H_TTFT_SLO_MS: "100"}, tenant="t", flow=flow, model=model).slo == Slo(0.1, None)
    assert ask_of({}, tenant="t", flow=FlowConfig(), model=None).plain


@pytest.mark.parametrize("value", ["fast", "0", "-5", "1e12"])
def test_ask_refuses_a_malformed_target(value: str) -> None:
    with pytest.raises(BadRequestError, match="x-zml-ttft-slo-ms"):
        ask_of({subjects.H_TTFT_SLO_MS: value}, tenant="t", flow=FlowConfig(), model=None)


# --- token-fair shares ------------------------------------------------------------------------
def test_cost_weighs_prompt_at_prefill_and_output_at_decode() -> None:
    book = ShareBook("r1", prefill_cost=1.0, decode_cost=2.0)
    assert book.cost(800, 200) == 1200.0


def test_counters_decay_with_their_half_life() -> None:
    book = ShareBook("r1", half_life_s=10.0)
    book.charge("a", 1000.0, NOW)
    assert book.tokens("a", NOW + 10.0) == pytest.approx(500.0)
    assert book.tokens("a", NOW + 20.0) == pytest.approx(250.0)


def test_service_is_per_unit_of_weight() -> None:
    book = ShareBook("r1")
    book.charge("a", 1000.0, NOW)
    book.charge("b", 1000.0, NOW)
    assert book.service("a", 2.0, NOW) == pytest.approx(book.service("b", 1.0, NOW) / 2)


def test_a_peer_report_adds_its_counters_and_a_newer_one_replaces_it() -> None:
    r1, r2 = ShareBook("r1", half_life_s=10.0), ShareBook("r2", half_life_s=10.0)
    r2.charge("a", 400.0, NOW)
    r1.charge("a", 100.0, NOW)
    r1.merge(r2.report(NOW), NOW)
    assert r1.tokens("a", NOW) == pytest.approx(500.0, abs=0.1)
    r2.charge("a", 400.0, NOW + 1)
    r1.merge(r2.report(NOW + 1), NOW + 1)
    old = r2.report(NOW)  # late delivery of an older report changes nothing
    r1.merge(old, NOW + 1)
    expect = 100 * 0.5 ** 0.1 + r2.tokens("a", NOW + 1)
    assert r1.tokens("a", NOW + 1) == pytest.approx(expect, abs=0.2)


def test_a_tenants_backlog_is_every_replicas_and_a_change_is_reported() -> None:
    """Each replica holds a window of the saturation queue: a flood's 36 waiting requests may sit
    31 in one replica's window and 5 in the other's. Judged by its own 5, the second replica
    found the flood under its backlog bound (not over its share) and let it into the slot kept
    for others (4 of 4 slots ran the flood half the time, tests/e2e/test_flow_control.py)."""
    from zmlcore.flowctl.gate import over_share
    r1, r2 = ShareBook("r1"), ShareBook("r2")
    r1.set_waiting({"flood": 31, "steady": 1})
    v = r1.version
    r1.set_waiting({"flood": 31, "steady": 1})
    assert r1.version == v  # unchanged: nothing to report
    r1.set_waiting({"flood": 31})
    assert r1.version == v + 1
    r2.set_waiting({"flood": 5})
    r2.merge(r1.report(NOW), NOW)
    assert r2.waiting("flood") == 36 and r2.waiting("steady") == 0
    assert not over_share(1.9, r2.own_waiting["flood"]) and over_share(1.9, r2.waiting("flood"))
    r1.set_waiting({})
    r2.merge(r1.report(NOW + 1), NOW + 1)
    assert r2.waiting("flood") == 5


def test_a_flood_held_partly_elsewhere_still_ranks_as_over_its_share() -> None:
    """The order's backlog test counts the tenant's entries in the other replicas' windows too:
    with 5 of a flood's 36 here, they ranked as an under-share tenant's, this replica announced
    that band, and the replica holding the other 31 left it every freed slot it could not use."""
    from zmlcore.flowctl.order import best_rank, keys
    ws = [Waiting(band=STANDARD, tenant="flood", weight=1.0, enqueued_at=NOW, seq=i) for i in range(5)]

    def service(t: str, w: float) -> float:
        return 1000.0 if t == "flood" else 0.0
    assert best_rank(ws, service, NOW, 30.0, level=10.0) == (STANDARD, 0)
    assert best_rank(ws, service, NOW, 30.0, level=10.0, elsewhere={("flood", STANDARD): 31}) == (STANDARD, 1)
    assert all(k[1] == 0 for k in keys(ws, service, NOW, 30.0, 10.0, elsewhere={("other", STANDARD): 31}))
    # its backlog in another band is not its backlog in this one (fair shares are within a band)
    assert best_rank(ws, service, NOW, 30.0, level=10.0, elsewhere={("flood", SHEDDABLE): 31}) == (STANDARD, 0)


def test_own_report_is_ignored_and_stale_peers_forgotten() -> None:
    r1 = ShareBook("r1", half_life_s=1.0)
    r1.charge("a", 100.0, NOW)
    r1.merge(r1.report(NOW), NOW)
    assert r1.tokens("a", NOW) == pytest.approx(100.0)
    r2 = ShareBook("r2", half_life_s=1.0)
    r2.charge("b", 100.0, NOW)
    r1.merge(r2.report(NOW), NOW)
    r1.merge(ShareBook("r3", half_life_s=1.0).report(NOW + 100), NOW + 100)
    assert "r2" not in r1.peers


def test_share_used_is_a_multiple_of_the_fair_share() -> None:
    book = ShareBook("r1")
    book.charge("a", 3000.0, NOW)
    book.charge("b", 1000.0, NOW)
    assert book.share_used("a", 1.0, NOW) == pytest.approx(1.5)
    assert book.share_used("b", 1.0, NOW) == pytest.approx(0.5)
    assert book.share_used("c", 1.0, NOW) == 0.0


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def test_four_replicas_with_lag_are_one_fair_scheduler() -> None:
    """Saturated: every tenant always has work waiting at every replica; each replica serves its
    next slot to the tenant with the least service as it sees it (its own counts plus peers'
    reports 1-5 ms old, published every 100 ms). Tokens served stay fair (Jain >= 0.95) even
    though requests differ 10x in size between tenants."""
    rnd = random.Random(7)
    reps = [ShareBook(f"r{i}", half_life_s=30.0) for i in range(4)]
    tenants = {"small": 200, "medium": 800, "large": 2000, "huge": 4000}  # tokens per request
    served = dict.fromkeys(tenants, 0.0)
    inbox: list[tuple[float, int, object]] = []
    t = NOW
    last_report = [t] * 4
    while t < NOW + 120.0:
        t += 0.002
        i = rnd.randrange(4)
        book = reps[i]
        for when, to, rep in [m for m in inbox if m[0] <= t]:
            reps[to].merge(rep, t)  # type: ignore[arg-type]
        inbox = [m for m in inbox if m[0] > t]
        who = min(tenants, key=lambda n: (book.service(n, 1.0, t), rnd.random()))
        cost = tenants[who] * (0.5 + rnd.random())
        book.charge(who, cost, t)
        if t > NOW + 20.0:
            served[who] += cost
        if t - last_report[i] >= 0.1:
            last_report[i] = t
            rep = book.report(t)
            for j in range(4):
                if j != i:
                    inbox.append((t + rnd.uniform(0.001, 0.005), j, rep))
    assert jain(list(served.values())) >= 0.95


# --- the queue's order ------------------------------------------------------------------------
def _w(band: int, tenant: str, seq: int, at: float = NOW, weight: float = 1.0) -> Waiting:
    return Waiting(band=band, tenant=tenant, weight=weight, enqueued_at=at, seq=seq)


def test_a_higher_band_overtakes_a_lower_band_burst() -> None:
    ws = [_w(SHEDDABLE, "a", i) for i in range(50)] + [_w(CRITICAL, "b", 99)]
    assert pick(ws, lambda t, w: 0.0, NOW, age_s=30.0) == 50


def test_within_a_band_a_backlogged_over_share_tenant_goes_after_the_others() -> None:
    served = {"flood": 1e6, "steady": 10.0}
    ws = [_w(STANDARD, "flood", i) for i in range(10)] + [_w(STANDARD, "steady", 20), _w(STANDARD, "steady", 21)]
    assert ranked(ws, lambda t, w: served[t] / w, NOW, 30.0, level=1000.0)[:2] == [10, 11]
    # the same flood without a backlog is just another tenant, in arrival order
    assert pick(ws[9:], lambda t, w: served[t] / w, NOW, age_s=30.0, level=1000.0) == 0


def test_backlogged_tenants_share_by_tokens_and_weight() -> None:
    """Start-time fair queueing among backlogged over-share tenants: a's requests cost 4x b's,
    so b gets 4 entries per a's one; with weight 2, a gets twice that."""
    ws = [Waiting(STANDARD, "a", 1.0, NOW, i, cost=400.0) for i in range(10)]
    ws += [Waiting(STANDARD, "b", 1.0, NOW, 100 + i, cost=100.0) for i in range(40)]
    first10 = ranked(ws, lambda t, w: 1000.0, NOW, 30.0, level=500.0)[:10]
    assert sum(1 for i in first10 if ws[i].tenant == "b") == 8
    ws2 = [Waiting(STANDARD, "a", 2.0, NOW, i, cost=400.0) for i in range(10)]
    ws2 += [Waiting(STANDARD, "b", 1.0, NOW, 100 + i, cost=100.0) for i in range(40)]
    first12 = ranked(ws2, lambda t, w: 1000.0, NOW, 30.0, level=400.0)[:12]
    assert sum(1 for i in first12 if ws2[i].tenant == "a") == 4


def test_a_floods_backlog_goes_after_each_others_next_request() -> None:
    """A flood held back to spare capacity may have served little more than its share; its
    backlog still goes after another tenant's next request."""
    ws = [Waiting(STANDARD, "flood", 1.0, NOW, i, cost=1000.0) for i in range(50)]
    ws.append(Waiting(STANDARD, "steady", 1.0, NOW, 100, cost=1000.0))
    order = ranked(ws, lambda t, w: {"flood": 410.0, "steady": 500.0}[t], NOW, 30.0, level=400.0)
    assert order[0] == 50


def test_tenants_at_their_share_without_a_backlog_go_in_arrival_order() -> None:
    svc = {"a": 90.0, "b": 110.0, "c": 100.0}
    ws = [_w(STANDARD, t, seq) for seq, t in enumerate("bca")]
    assert ranked(ws, lambda t, w: svc[t], NOW, 30.0, level=100.0) == [0, 1, 2]


def test_weight_divides_service() -> None:
    ws = [Waiting(STANDARD, "a", 2.0, NOW, i, cost=100.0) for i in range(8)]
    ws += [Waiting(STANDARD, "b", 1.0, NOW, 10 + i, cost=100.0) for i in range(8)]
    served = {"a": 300.0, "b": 200.0}
    assert ranked(ws, lambda t, w: served[t] / w, NOW, 30.0, level=100.0)[0] == 0  # a: 150 per weight


def test_sheddable_ages_up_to_standard_never_above() -> None:
    w = _w(SHEDDABLE, "a", 1, at=NOW)
    assert effective_band(w, NOW + 29, 30.0) == SHEDDABLE
    assert effective_band(w, NOW + 31, 30.0) == STANDARD
    assert effective_band(_w(CRITICAL, "a", 1), NOW + 500, 30.0) == CRITICAL
    assert effective_band(w, NOW + 500, 0.0) == SHEDDABLE  # no aging


def test_batch_rises_only_when_its_window_is_closing() -> None:
    w = Waiting(band=BATCH, tenant="b", weight=1.0, enqueued_at=NOW, seq=1, urgent_at=NOW + 3600)
    assert effective_band(w, NOW + 600, 30.0) == BATCH
    assert effective_band(w, NOW + 3600, 30.0) == STANDARD
    ws = [_w(STANDARD, "a", 2, at=NOW + 3601), w]
    assert pick(ws, lambda t, wt: 0.0, NOW + 3599, 30.0) == 0
    assert pick(ws, lambda t, wt: 0.0, NOW + 3601, 30.0) == 1  # urgent: a standard entry, in arrival order


def test_an_aged_entry_competes_with_standard_work_by_share_and_arrival() -> None:
    old = _w(SHEDDABLE, "a", 1, at=NOW - 60)
    new = _w(STANDARD, "b", 2)
    assert pick([new, old], lambda t, w: 0.0, NOW, age_s=30.0) == 1


def test_displacement_sheds_the_lowest_band_first() -> None:
    ws = [_w(STANDARD, "a", 1), _w(SHEDDABLE, "a", 2), _w(CRITICAL, "b", 3), _w(SHEDDABLE, "b", 4)]
    assert sorted(displaced(ws, lambda t, w: 0.0, NOW, 30.0, limit=2)) == [1, 3]
    assert displaced(ws, lambda t, w: 0.0, NOW, 30.0, limit=4) == []


def test_displacement_takes_the_floods_newest_entries() -> None:
    ws = [Waiting(STANDARD, "flood", 1.0, NOW, i, cost=100.0) for i in range(10)]
    ws += [Waiting(STANDARD, "steady", 1.0, NOW, 20, cost=100.0), Waiting(STANDARD, "other", 1.0, NOW, 21, cost=100.0)]
    svc = {"flood": 500.0, "steady": 50.0, "other": 50.0}
    assert displaced(ws, lambda t, w: svc[t], NOW, 30.0, limit=9, level=100.0) == [9, 8, 7]


# --- SLO admission ----------------------------------------------------------------------------
def _fleet() -> list[NodeView]:
    return [NodeView(NodeState(node_id=node_id, accelerator_type=acc, family=fam, endpoint="http://x", status="up",
                               models=["m"], updated_at=NOW, cost_per_hour=cost))
            for node_id, acc, fam, cost in (("h1", "nvidia_h100", "H100", 4.0), ("g1", "intel_gaudi2", "Gaudi2", 0.5))]


def _admit(nodes: list[NodeView], rr: RouteRequest, slo: Slo, policy: str = "latency"):  # type: ignore[no-untyped-def]
    return admit_slo(nodes, rr, builtin_policy(policy), NOW, RoutingState(), slo, stale_after_s=15.0,
                     ttft_bound_s=60.0)


def test_tpot_grows_with_the_batch_and_is_slower_on_slower_nodes() -> None:
    h, g = (v.state for v in _fleet())
    assert tpot_at(h, 1) < tpot_at(h, 16) < tpot_at(h, 32)
    assert tpot_at(g, 1) > tpot_at(h, 1)
    assert tpot_at(h, 500) == tpot_at(h, 32)  # beyond its slots a request waits, then decodes at full batch


def test_measured_decode_speed_sets_tpot() -> None:
    st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="", decode_tps=30.0)
    assert tpot_at(st, 1) > 1 / 30.0


def test_the_policy_pick_is_kept_when_it_meets_the_slo() -> None:
    d, v = _admit(_fleet(), RouteRequest(model="m", prompt_tokens=1000), Slo(0.5, 0.05))
    assert d.node_id == "h1" and v.met and v.ttft_s < 0.5 and v.tpot_s < 0.05


def test_a_pick_that_misses_is_replaced_by_a_node_that_meets_it() -> None:
    nodes = _fleet()
    d, v = _admit(nodes, RouteRequest(model="m", prompt_tokens=1000), Slo(0.5, None), policy="cost")
    assert d.node_id == "g1"  # the cost pick, fine for TTFT
    d, v = _admit(nodes, RouteRequest(model="m", prompt_tokens=1000), Slo(0.5, 0.025), policy="cost")
    assert d.node_id == "h1" and v.tpot_s <= 0.025  # Gaudi2 decodes too slowly for 25 ms/token


def test_no_node_meeting_the_ttft_target_is_refused_at_once_with_retry_after() -> None:
    nodes = _fleet()
    for v in nodes:
        v.set_counts(40, 20)
    with pytest.raises(SloUnattainableError) as info:
        _admit(nodes, RouteRequest(model="m", prompt_tokens=1000), Slo(0.3, None))
    e = info.value
    assert e.code == "SLO_UNATTAINABLE" and e.retry_after is not None and 0.5 <= e.retry_after <= 60
    assert e.routing_context is not None and e.routing_context["slo"] == {"ttft_ms": 300}


def test_a_target_no_node_meets_even_idle_is_refused_without_retry_after() -> None:
    with pytest.raises(SloUnattainableError) as info:
        _admit(_fleet(), RouteRequest(model="m", prompt_tokens=100), Slo(None, 0.005))
    assert info.value.retry_after is None and "even idle" in info.value.message
    with pytest.raises(SloUnattainableError) as info:
        _admit(_fleet(), RouteRequest(model="m", prompt_tokens=8000), Slo(0.1, None))
    assert info.value.retry_after is None and "prefill alone" in info.value.message


def test_a_busy_fast_node_sends_the_tpot_bound_request_elsewhere() -> None:
    nodes = [NodeView(NodeState(node_id=f"h{i}", accelerator_type="nvidia_h100", family="H100", endpoint="x",
                                status="up", models=["m"], updated_at=NOW)) for i in (1, 2)]
    nodes[0].set_counts(31, 0)
    assert predict_tpot(nodes[0]) > predict_tpot(nodes[1])
    d, v = _admit(nodes, RouteRequest(model="m", prompt_tokens=100), Slo(None, predict_tpot(nodes[1]) + 1e-6),
                  policy="round_robin")
    assert d.node_id == "h2"


def test_saturation_passes_through_and_the_queue_budget_subtracts_own_prefill() -> None:
    nodes = _fleet()
    for v in nodes:
        v.set_counts(2000, 0)
    with pytest.raises(QueueFullError):
        _admit(nodes, RouteRequest(model="m", prompt_tokens=1000), Slo(5.0, None))
    budget = queue_budget_s(nodes, RouteRequest(model="m", prompt_tokens=1000), Slo(5.0, None), NOW, 15.0)
    assert budget == pytest.approx(5.0 - 0.1)
    assert queue_budget_s(nodes, RouteRequest(model="m"), Slo(None, 0.1), NOW, 15.0) is None
    assert math.isfinite(predict_tpot(nodes[0]))


# --- the gate: hold when full, over-share tenants leave a reserve ------------------------------
def _ask(band: int = STANDARD, slo: Slo | None = None):  # type: ignore[no-untyped-def]
    from zmlcore.flowctl import Ask
    return Ask(band, False, "t", 1.0, slo)


def _gate(nodes: list[NodeView], ask, over_share: bool = False, hold: bool = True):  # type: ignore[no-untyped-def]
    from zmlcore.flowctl.gate import admit_flow
    return admit_flow(nodes, RouteRequest(model="m", prompt_tokens=500), builtin_policy("latency"), NOW,
                      RoutingState(), ask, over_share=over_share, flow=FlowConfig(hold_when_full=hold, spare_reserve=0.1),
                      stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1)


def test_with_hold_when_full_a_node_without_a_free_slot_takes_nothing() -> None:
    nodes = _fleet()
    nodes[0].set_counts(32, 0)  # H100: 32 slots, all taken
    d, v = _gate(nodes, _ask())
    assert d.node_id == "g1" and v is None
    nodes[1].set_counts(16, 0)
    with pytest.raises(QueueFullError) as info:
        _gate(nodes, _ask())
    assert info.value.routing_context["final_error"] == "no_free_slot"  # type: ignore[index]
    d, _ = _gate(nodes, _ask(), hold=False)  # without it: today's admission bound only
    assert d.node_id in ("h1", "g1")


def test_the_other_replicas_unseen_sends_count_as_taken_slots() -> None:
    """Two replicas, a burst reaching both at once: each sees only its own sends until the
    other's deltas arrive, so each counts as many for the other (unseen_by_peers) and the two
    together fill the node's slots, not twice them."""
    from zmlcore.flowctl.gate import admit_flow, full_nodes, unseen_by_peers
    nodes = _fleet()[:1]  # h1: an H100 of 32 slots
    nodes[0].set_counts(16, 0)  # 16 are this replica's own, sent within the last moment
    assert unseen_by_peers({"h1": 16}, peers=0) == {}  # alone: nothing unseen
    assert unseen_by_peers({"h1": 16, "g1": 0}, peers=1) == {"h1": 16}
    assert unseen_by_peers({"h1": 3}, peers=2) == {"h1": 6}
    assert full_nodes(nodes, 0.0) == frozenset()
    assert full_nodes(nodes, 0.0, {"h1": 15}) == frozenset()  # 16 + 15 + this one: the last slot
    assert full_nodes(nodes, 0.0, {"h1": 16}) == {"h1"}
    assert full_nodes(nodes, 0.0, {"g1": 99}) == frozenset()  # another node's sends do not count

    def gate(unseen: dict[str, int] | None):  # type: ignore[no-untyped-def]
        return admit_flow(nodes, RouteRequest(model="m", prompt_tokens=500), builtin_policy("latency"), NOW,
                          RoutingState(), _ask(), over_share=False, flow=FlowConfig(hold_when_full=True),
                          stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1, unseen=unseen)

    assert gate(None)[0].node_id == "h1"
    with pytest.raises(QueueFullError):
        gate(unseen_by_peers({"h1": 16}, peers=1))  # waits in the saturation queue for a slot
    # without [flow] hold_when_full the guard has no say (the engines' own queues take the rest)
    d, _ = admit_flow(nodes, RouteRequest(model="m", prompt_tokens=500), builtin_policy("latency"), NOW,
                      RoutingState(), _ask(), over_share=False, flow=FlowConfig(hold_when_full=False),
                      stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1, unseen={"h1": 99})
    assert d.node_id == "h1"


def test_an_over_share_tenant_and_sheddable_work_leave_the_reserve_free() -> None:
    nodes = _fleet()
    nodes[0].set_counts(29, 0)  # 3 free of 32: one more leaves 2 < ceil(3.2) = 4 reserved
    nodes[1].set_counts(14, 0)  # 2 free of 16: one more leaves 1 < 2 reserved
    assert _gate(nodes, _ask())[0].node_id in ("h1", "g1")
    with pytest.raises(QueueFullError):
        _gate(nodes, _ask(), over_share=True)
    with pytest.raises(QueueFullError):
        _gate(nodes, _ask(SHEDDABLE))


def _one_node(slots: int, running: int) -> list[NodeView]:
    v = NodeView(NodeState(node_id="n", accelerator_type="amd_mi300x", family="MI300X", endpoint="http://x",
                           status="up", models=["m"], updated_at=NOW, max_concurrency=slots))
    v.set_counts(running, 0)
    return [v]


def test_two_replicas_deciding_at_once_never_fill_the_reserve_with_spare_only_work() -> None:
    """The live flood's lost reserve (tests/e2e/test_flow_control.py): a 4-slot node, 1 slot kept
    free, the flood holding 2 of the 3 others (one from each replica). A slot frees and both
    replicas, woken by it at once, see 2 running: judged on the shared count alone each sends
    one more and the flood holds all 4. Each judged on its own part of the spare slots (split
    by the entries each holds), only the one whose part has room sends."""
    from zmlcore.flowctl.gate import SpareSplit, spare_part
    nodes = _one_node(4, 2)
    held = {"r1": 17, "r2": 19}
    assert spare_part(3, "r1", held) + spare_part(3, "r2", held) == 3
    flow = FlowConfig(hold_when_full=True, spare_reserve=0.25)

    def gate(me: str, own: int, split: bool = True):  # type: ignore[no-untyped-def]
        return admit_flow(nodes, RouteRequest(model="m", prompt_tokens=50), builtin_policy("latency"), NOW,
                          RoutingState(), _ask(), over_share=True, flow=flow, stale_after_s=15.0,
                          ttft_bound_s=60.0, reserve=0.1,
                          split=SpareSplit(me, {"n": own}, held) if split else None)

    from zmlcore.flowctl.gate import admit_flow
    sent = 0
    for me in ("r1", "r2"):  # the same instant: neither has seen the other's send
        try:
            gate(me, own=1)
            sent += 1
        except QueueFullError:
            pass
    assert sent == 1  # 3 running: the 4th slot stays the reserve
    assert gate("r2", own=1, split=False)[0].node_id == "n" and gate("r1", own=1, split=False)[0].node_id == "n"
    # a request that does not take spare capacity only is not held to a part
    d, _ = admit_flow(nodes, RouteRequest(model="m", prompt_tokens=50), builtin_policy("latency"), NOW,
                      RoutingState(), _ask(), over_share=False, flow=flow, stale_after_s=15.0, ttft_bound_s=60.0,
                      reserve=0.1, split=SpareSplit("r1", {"n": 9}, held))
    assert d.node_id == "n"


def test_the_spare_slots_are_split_by_the_entries_each_replica_holds() -> None:
    from zmlcore.flowctl.gate import spare_part
    # each holder gets one (its window drains), the rest goes by size; the parts add up
    for held in ({"r1": 1, "r2": 38}, {"r1": 18, "r2": 19}, {"a": 5, "b": 5, "c": 5}, {"a": 0, "b": 40}):
        for spare in (1, 2, 3, 7, 24):
            parts = {r: spare_part(spare, r, held) for r in held}
            assert sum(parts.values()) == spare, (held, spare, parts)
    assert [spare_part(3, r, {"r1": 1, "r2": 38}) for r in ("r1", "r2")] == [1, 2]
    assert [spare_part(24, r, {"r1": 10, "r2": 30}) for r in ("r1", "r2")] == [6, 18]
    assert spare_part(3, "r1", {}) == 3 and spare_part(3, "r1", {"r1": 4}) == 3  # alone: all of it
    assert spare_part(3, "r3", {"r1": 4, "r2": 4}) == 1  # a replica deciding a request it holds no entry of


# --- the over-share gate by band (issue 30, items 1 and 4) --------------------------------------
def _flooding_book() -> ShareBook:
    """A replica's book where tenant "x" has had 9/10 of the recent tokens and keeps 10
    ``standard`` requests waiting (6 here, 4 in a peer's window): over its share in ``standard``."""
    from zmlcore.messages.flow import ShareReport
    book = ShareBook("r1")
    book.charge("x", 900.0, NOW)
    book.charge("z", 100.0, NOW)
    book.set_waiting({"x": 6}, {"standard": 6}, {"standard": {"x": 6}})
    book.merge(ShareReport(replica="r2", at=NOW, waiting={"x": 4}, backlog={"standard": {"x": 4}}), NOW)
    return book


def test_a_tenants_lower_band_backlog_does_not_hold_back_its_higher_band_request() -> None:
    """Fair shares are within a band: "x" floods ``standard`` (over its share there, held to spare
    capacity), but its ``critical`` request is not over its share in ``critical`` and takes a free
    slot the reserve included. Before, its backlog in any band made every request of it yield."""
    from zmlcore.flowctl.gate import admit_flow, standing
    book = _flooding_book()
    assert standing(book, "x", 1.0, NOW, STANDARD)[1] and not standing(book, "x", 1.0, NOW, CRITICAL)[1]
    nodes = _one_node(4, 3)  # one slot free: the reserve of spare-only work
    flow = FlowConfig(hold_when_full=True, spare_reserve=0.25)

    def gate(band: int):  # type: ignore[no-untyped-def]
        from zmlcore.flowctl import Ask
        return admit_flow(nodes, RouteRequest(model="m", prompt_tokens=50), builtin_policy("latency"), NOW,
                          RoutingState(), Ask(band, False, "x", 1.0, None),
                          over_share=standing(book, "x", 1.0, NOW, band)[1], flow=flow, stale_after_s=15.0,
                          ttft_bound_s=60.0, reserve=0.1)

    assert gate(CRITICAL)[0].node_id == "n"
    with pytest.raises(QueueFullError):
        gate(STANDARD)


def test_in_the_queue_a_tenants_higher_band_entry_ranks_with_its_band_not_behind_it() -> None:
    """Within ``critical``, "x"'s entry is not an over-share tenant's because of its ``standard``
    flood: it keeps its arrival order among the band's entries (before "z"'s later one), and the
    window announces ``critical`` within-share work."""
    from zmlcore.flowctl.order import rank_window
    book = _flooding_book()
    ws = [Waiting(band=STANDARD, tenant="x", weight=1.0, enqueued_at=NOW, seq=i, cost=100.0) for i in range(6)]
    ws += [Waiting(band=CRITICAL, tenant="x", weight=1.0, enqueued_at=NOW, seq=10, cost=100.0),
           Waiting(band=CRITICAL, tenant="z", weight=1.0, enqueued_at=NOW, seq=11, cost=100.0)]
    r = rank_window(ws, book, NOW, age_s=30.0, max_queued=256)
    assert r.order[:2] == [6, 7] and r.top == (CRITICAL, 0)


def test_a_lower_band_leaves_the_reserve_while_higher_band_work_waits() -> None:
    """The reserve spare-only work leaves is for the next request of the band that waits: a
    ``critical`` flood over its share leaves it, and a ``standard`` request (its tenant under its
    share) must not take it while ``critical`` work waits; it may once none does, and a
    ``critical`` request may anyway."""
    from zmlcore.flowctl.gate import admit_flow, no_room
    nodes = _one_node(4, 3)
    flow = FlowConfig(hold_when_full=True, spare_reserve=0.25)

    def gate(band: int, waiting: tuple[int, int] | None):  # type: ignore[no-untyped-def]
        return admit_flow(nodes, RouteRequest(model="m", prompt_tokens=50), builtin_policy("latency"), NOW,
                          RoutingState(), _ask(band), over_share=False, flow=flow, stale_after_s=15.0,
                          ttft_bound_s=60.0, reserve=0.1, waiting=waiting)

    with pytest.raises(QueueFullError):
        gate(STANDARD, (CRITICAL, 1))
    assert no_room(nodes, _ask(STANDARD), over_share=False, flow=flow, waiting=(CRITICAL, 1)) == {"n"}
    assert gate(STANDARD, (STANDARD, 1))[0].node_id == "n"  # the same band's over-share work waits: not held
    assert gate(STANDARD, None)[0].node_id == "n"
    assert gate(CRITICAL, (CRITICAL, 1))[0].node_id == "n"


def test_the_gate_passes_targets_to_slo_admission() -> None:
    nodes = _fleet()
    d, v = _gate(nodes, _ask(CRITICAL, Slo(0.5, 0.05)))
    assert v is not None and v.ttft_s <= 0.5
    with pytest.raises(SloUnattainableError):
        _gate(nodes, _ask(CRITICAL, Slo(None, 0.001)))


def test_a_worse_entry_never_takes_a_slot_a_skipped_better_one_has_room_for_now() -> None:
    # Room opens between two asks (a peer's unseen send ages out): the better-ranked entry that
    # was refused a moment ago is asked again, and goes first.
    from zmlcore.flowctl.order import first_with_room
    asked: list[tuple[int, int]] = []
    opened = {"at": 3}

    def has_room(i: int, ahead: int) -> bool:
        asked.append((i, ahead))
        return len(asked) >= opened["at"]

    assert first_with_room([7, 4, 9], has_room) == 7
    assert asked == [(7, 0), (4, 1), (9, 2), (7, 0)]  # each asked with the entries before it
    asked.clear()
    opened["at"] = 99
    assert first_with_room(list(range(20)), has_room) is None and len(asked) == 8  # TRIES


def test_a_windows_ranking_counts_the_peers_backlog_and_records_its_own() -> None:
    from zmlcore.flowctl.order import rank_window
    from zmlcore.messages.flow import ShareReport
    book = ShareBook("r1")
    book.charge("flood", 5000.0, 0.0)
    book.charge("steady", 100.0, 0.0)
    ws = [Waiting(band=1, tenant="flood", weight=1, enqueued_at=0, seq=1, cost=300.0),
          Waiting(band=1, tenant="steady", weight=1, enqueued_at=1, seq=2, cost=300.0)]
    alone = rank_window(ws, book, 1.0, age_s=30.0, max_queued=256)
    assert alone.order == [0, 1] and alone.top == (1, 0)  # one flood entry here: no backlog, arrival order
    book.merge(ShareReport(replica="r2", at=1.0, waiting={"flood": 30}, backlog={"standard": {"flood": 30}}), 1.0)
    both = rank_window(ws, book, 1.0, age_s=30.0, max_queued=256)
    assert both.order == [1, 0] and both.top == (1, 0)  # the flood's backlog is the peer's too: it goes after
    assert book.own_waiting == {"flood": 1, "steady": 1}
    assert book.own_backlog == {"standard": {"flood": 1, "steady": 1}}  # by band too: reported to the peers
