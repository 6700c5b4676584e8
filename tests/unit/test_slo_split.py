"""SLO admission and the split decider together (zmlcore.flowctl.slo, zmlcore.policy.split): a
request with targets is refused only when neither whole on any node nor split over any pair
meets them, and a refusal names the best estimate, the pair's included. Pure: no router."""

from __future__ import annotations

import pytest

from zmlcore.config import FlowConfig
from zmlcore.errors import SloUnattainableError
from zmlcore.flowctl import Ask, Pairs, Slo, admit_slo, predict_tpot
from zmlcore.flowctl.gate import admit_flow
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState
from zmlcore.policy.resolve import builtin_policy
from zmlcore.policy.split import KVLinks, SplitIndex, SplitSettings, decide_split

NOW = 1_000.0
RR = RouteRequest(model="m", prompt_tokens=6000, max_tokens=200)


def node(i: str, pf: float, dec: float, roles: list[str] | None = None, group: str = "g") -> NodeView:
    return NodeView(NodeState(node_id=i, accelerator_type="nvidia_h100", family=i.upper(), endpoint="http://x",
                              status="up", models=["m"], updated_at=NOW, prefill_tps=pf, decode_tps=dec,
                              roles=roles or [], kv_group=group, kv_gbps=400.0))


def splitwise() -> list[NodeView]:
    """A node that prefills fast and decodes slowly beside one the other way round: neither
    serves a 6,000-token prompt whole in 1 s at 50 ms/token (the first decodes at ~67 ms, the
    second prefills for 4 s); prefilled on the first and decoded on the second, it is served
    in ~0.32 s at ~19 ms/token."""
    return [node("fastpre", 20000.0, 15.0), node("fastdec", 1500.0, 60.0)]


def admit(nodes: list[NodeView], slo: Slo, pairs: Pairs | None, rr: RouteRequest = RR, policy: str = "latency"):  # type: ignore[no-untyped-def]
    return admit_slo(nodes, rr, builtin_policy(policy), NOW, RoutingState(), slo, stale_after_s=15.0,
                     ttft_bound_s=60.0, pairs=pairs)


def pairs_of(nodes: list[NodeView], indexed: bool, **kw: object) -> Pairs:
    return Pairs(nodes, SplitSettings(), KVLinks(), index=SplitIndex(nodes) if indexed else None, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("indexed", [False, True])
def test_no_whole_node_meets_the_targets_but_a_pair_does_so_it_is_admitted_split(indexed: bool) -> None:
    nodes = splitwise()
    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    with pytest.raises(SloUnattainableError):  # whole only (a request that may not be split): refused
        admit(nodes, slo, None)
    d, verdict = admit(nodes, slo, pairs_of(nodes, indexed))
    assert (d.prefill_node, d.node_id) == ("fastpre", "fastdec")
    assert d.transfer_tokens == 6000 and d.transfer_s > 0 and d.cached_tokens == 0
    # the verdict is the pair's: the decider's time to first token, the decode node's TPOT
    assert verdict.met and verdict.ttft_s == d.estimated_ttft_s < 1.0
    assert verdict.tpot_s == pytest.approx(predict_tpot(nodes[1])) and verdict.tpot_s < 0.05


@pytest.mark.parametrize("indexed", [False, True])
def test_nothing_meets_the_targets_so_it_is_refused_naming_the_best_split(indexed: bool) -> None:
    nodes = splitwise()
    nodes[1].set_counts(4, 2)  # two prompts to prefill before its turn on the decode node: the pair's first token ~1.4 s
    with pytest.raises(SloUnattainableError) as info:
        admit(nodes, Slo(ttft_s=0.4, tpot_s=0.05), pairs_of(nodes, indexed))
    e = info.value
    assert "best split (fastpre prefills, fastdec decodes)" in e.message and "ms/token" in e.message
    ctx = e.routing_context
    assert ctx is not None
    split = ctx["predicted_split"]
    assert (split["prefill_node"], split["node_id"]) == ("fastpre", "fastdec")
    assert 1000 < split["ttft_ms"] < 2000 and split["tpot_ms"] < 50
    # the pair would meet it once that backlog drains (whole, only after ~4.7 s): Retry-After from the pair's estimate
    assert e.retry_after is not None and e.retry_after == pytest.approx(max(0.5, split["ttft_ms"] / 1000 - 0.4), abs=0.01)


def test_a_target_below_any_prefill_is_refused_without_retry_naming_the_split() -> None:
    nodes = splitwise()
    with pytest.raises(SloUnattainableError) as info:
        admit(nodes, Slo(ttft_s=0.2, tpot_s=0.05), pairs_of(nodes, False))
    e = info.value
    assert e.retry_after is None and "prefill alone" in e.message and "best split" in e.message


def test_a_prefill_only_node_is_a_way_to_meet_the_target() -> None:
    # whole, only the decode node may serve it (4 s of prefill); its prefill-only peer does it in 0.3 s
    nodes = [node("p", 20000.0, 15.0, roles=["prefill"]), node("d", 1500.0, 60.0, roles=["decode"])]
    with pytest.raises(SloUnattainableError) as info:
        admit(nodes, Slo(ttft_s=1.0), None)
    assert "prefill alone takes 4000 ms" in info.value.message
    d, _ = admit(nodes, Slo(ttft_s=1.0), pairs_of(nodes, False))
    assert (d.prefill_node, d.node_id) == ("p", "d")


def test_a_pair_is_not_admitted_on_a_decode_node_too_slow_for_the_tpot_target() -> None:
    # two fast prefillers that decode slowly: a pair of them is faster to the first token, never in time per token
    nodes = [node("a", 20000.0, 15.0), node("b", 20000.0, 15.0), node("c", 1500.0, 60.0, group="other")]
    with pytest.raises(SloUnattainableError) as info:
        admit(nodes, Slo(ttft_s=1.0, tpot_s=0.05), pairs_of(nodes, False))
    assert "predicted_split" not in (info.value.routing_context or {})  # no decode node left for a pair


def test_a_request_whole_nodes_serve_in_time_is_not_split_by_admission() -> None:
    nodes = splitwise()
    d, _ = admit(nodes, Slo(ttft_s=5.0, tpot_s=0.05), pairs_of(nodes, False))
    assert d.node_id == "fastdec" and d.prefill_node == ""  # (whether to split then is the decider's, as without targets)


def test_the_legs_keep_off_nodes_without_room_under_hold_when_full() -> None:
    nodes = splitwise()
    nodes[0].set_counts(30, 0)  # 2 of the prefiller's 32 slots free: within the reserve a tenant over its share leaves
    ask = Ask(band=1, lowered=False, tenant="t", weight=1.0, slo=Slo(ttft_s=1.0, tpot_s=0.05))

    def go(flow: FlowConfig):  # type: ignore[no-untyped-def]
        return admit_flow(nodes, RR, builtin_policy("latency"), NOW, RoutingState(), ask, over_share=True, flow=flow,
                          stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1, pairs=pairs_of(nodes, False))

    d, _ = go(FlowConfig())
    assert d.prefill_node == "fastpre"  # without hold_when_full the reserve is not kept
    with pytest.raises(SloUnattainableError):
        go(FlowConfig(hold_when_full=True))


@pytest.mark.parametrize("indexed", [False, True])
def test_the_decider_puts_no_decode_leg_on_no_decode_nodes(indexed: bool) -> None:
    nodes = [node("p", 20000.0, 15.0), node("d1", 1500.0, 60.0), node("d2", 1500.0, 55.0)]
    kw = dict(model="m", prompt_tokens=6000, output_tokens=200, cached={}, settings=SplitSettings(),
              links=KVLinks(), now=NOW, index=SplitIndex(nodes) if indexed else None)
    free = decide_split(nodes, nodes[1], **kw)  # type: ignore[arg-type]
    barred = decide_split(nodes, nodes[1], no_decode=frozenset({"d1"}), **kw)  # type: ignore[arg-type]
    assert free.best_split is not None and free.best_split.node == "d1"
    assert barred.best_split is not None and barred.best_split.node == "d2" and barred.best_split.prefill_node == "p"
