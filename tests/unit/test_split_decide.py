"""The split decider (zmlcore.policy.split): when a request is split, over which pair, and
that the answer comes from measured speeds, queues, caches, links and prices, not names."""

from __future__ import annotations

import doctest
import random

import pytest

from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.split import KVLinks, SplitSettings, decide_split
from zmlcore.policy.split import decide as decide_mod
from zmlcore.policy.split import links as links_mod
from zmlcore.policy.choose import is_routable


def view(i: str, acc: str = "nvidia_h100", roles: list[str] | None = None, group: str = "g", gbps: float = 400.0,
         **kw: object) -> NodeView:
    st = NodeState(node_id=i, accelerator_type=acc, family=acc, endpoint="", status="up", models=["m"],
                   roles=roles or [], kv_group=group, kv_gbps=gbps, **{"updated_at": 0.0, **kw})  # type: ignore[arg-type]
    return NodeView(st)


def decide(nodes: list[NodeView], whole: NodeView | None, prompt: int = 6000, out: int = 200,
           cached: dict[str, int] | None = None, **kw: object):  # type: ignore[no-untyped-def]
    return decide_split(nodes, whole, model="m", prompt_tokens=prompt, output_tokens=out, cached=cached or {},
                        settings=kw.pop("settings", SplitSettings()), links=kw.pop("links", KVLinks()),  # type: ignore[arg-type]
                        now=0.0, **kw)  # type: ignore[arg-type]


def test_doctests() -> None:
    assert doctest.testmod(decide_mod).failed == 0
    assert doctest.testmod(links_mod).failed == 0


def busy(v: NodeView, n: int = 12) -> NodeView:
    v.outstanding = n
    return v


def test_a_long_prompt_next_to_busy_decoders_is_split() -> None:
    p, d = view("p", roles=["prefill"]), busy(view("d", "amd_mi300x", roles=["decode"]))
    dec = decide([p, d], d)
    assert dec.split and dec.reason == "split_better"
    assert dec.chosen is not None and (dec.chosen.prefill_node, dec.chosen.node) == ("p", "d")
    # the transfer: 6000 tokens x 128 KiB over 400 Gbit/s
    assert dec.chosen.transfer_tokens == 6000 and dec.chosen.transfer_s == pytest.approx(6000 * 131072 / 50e9)
    assert dec.whole is not None and dec.whole.node == "d" and dec.chosen.time_s < dec.whole.time_s


def test_a_short_prompt_is_served_whole() -> None:
    p, d = view("p", roles=["prefill"]), busy(view("d", roles=["decode"]))
    dec = decide([p, d], d, prompt=300)
    assert not dec.split and dec.reason == "short_prompt" and dec.chosen is not None and dec.chosen.node == "d"


def test_a_decode_node_holding_the_conversation_is_served_whole() -> None:
    p, d = view("p", roles=["prefill"]), busy(view("d", roles=["decode"]))
    assert decide([p, d], d, cached={"d": 5800}).reason == "short_prompt"
    # partly cached there: only what it lacks crosses the link
    dec = decide([p, d], d, cached={"d": 3000})
    assert dec.best_split is not None and dec.best_split.transfer_tokens == 3000


def test_no_kv_group_no_split() -> None:
    p, d = view("p", group=""), busy(view("d", group=""))
    assert decide([p, d], d).reason == "no_pair"
    p, d = view("p", group="a"), busy(view("d", group="b"))
    assert decide([p, d], d).reason == "no_pair"


def test_a_slow_link_keeps_the_request_whole() -> None:
    p, d = view("p", gbps=0.5), busy(view("d", gbps=0.5))
    dec = decide([p, d], d)
    assert not dec.split and dec.reason == "whole_better"
    assert dec.best_split is not None and dec.best_split.transfer_s > 10


def test_kv_links_override_the_ends() -> None:
    p, d = view("p", gbps=0.5), busy(view("d", gbps=0.5))
    dec = decide([p, d], d, links=KVLinks({("p", "d"): 800.0}))
    assert dec.split and dec.chosen is not None and dec.chosen.transfer_s == pytest.approx(6000 * 131072 / 100e9)


def test_roles_come_from_measured_speeds_not_names() -> None:
    # An "Inferentia2" measured 4x an "H100" at prefill: it prefills. Swap the measurements:
    # the other one does. Nothing in the decider reads a family or type name.
    def fleet(fast: str) -> tuple[list[NodeView], NodeView]:
        a = view("a", "aws_inferentia2", roles=["prefill"], prefill_tps=40_000.0 if fast == "a" else 2_000.0, decode_tps=60.0)
        b = view("b", "nvidia_h100", roles=["prefill"], prefill_tps=40_000.0 if fast == "b" else 2_000.0, decode_tps=60.0)
        d = busy(view("d", "intel_gaudi2", roles=["decode"], prefill_tps=2_000.0, decode_tps=60.0))
        return [a, b, d], d
    for fast in ("a", "b"):
        nodes, d = fleet(fast)
        dec = decide(nodes, d)
        assert dec.split and dec.chosen is not None and dec.chosen.prefill_node == fast and dec.chosen.node == "d"


def test_the_cost_objective_decodes_where_decoding_is_cheapest() -> None:
    p = view("p", roles=["prefill"])
    dear = busy(view("dear", roles=["decode"], cost_per_hour=8.0), 4)
    cheap = busy(view("cheap", roles=["decode"], cost_per_hour=1.0), 4)
    dec = decide([p, dear, cheap], dear, objective="cost", latency_target_s=5.0)
    assert dec.split and dec.chosen is not None and dec.chosen.node == "cheap"
    assert decide([p, dear, cheap], dear, objective="latency").chosen.node in ("dear", "cheap")  # type: ignore[union-attr]


def test_excluded_and_unroutable_nodes_are_not_legs() -> None:
    p1, p2, d = view("p1", roles=["prefill"]), view("p2", "amd_mi300x", roles=["prefill"]), busy(view("d", roles=["decode"]))
    first = decide([p1, p2, d], d)
    assert first.chosen is not None and first.chosen.prefill_node == "p1"
    again = decide([p1, p2, d], d, exclude=frozenset({"p1"}))
    assert again.chosen is not None and again.chosen.prefill_node == "p2"
    p2.cooldown_until = 10.0
    assert decide([p1, p2, d], d, exclude=frozenset({"p1"})).reason == "no_pair"


def test_hysteresis_holds_a_conversation_in_its_mode() -> None:
    # Find a link speed where split and whole are within min_gain of each other.
    s = SplitSettings(min_gain=0.2)
    for gbps in [x / 4 for x in range(1, 4000)]:
        p, d = view("p", gbps=gbps), busy(view("d", gbps=gbps))
        dec = decide([p, d], d, settings=s)
        assert dec.best_split is not None and dec.whole is not None
        if 0.85 < dec.best_split.score / dec.whole.score < 0.95:
            break
    else:
        pytest.fail("no link speed puts the two modes within min_gain")
    assert not decide([p, d], d, settings=s).split
    assert decide([p, d], d, settings=s, previous="split").split
    assert not decide([p, d], d, settings=s, previous="whole").split
    assert decide([p, d], d, settings=SplitSettings(min_gain=0.0)).split


def test_unchanged_inputs_never_flip_a_conversation() -> None:
    rng = random.Random(7)
    flips = 0
    for _ in range(300):
        nodes = [view(f"n{i}", rng.choice(["nvidia_h100", "amd_mi300x", "intel_gaudi2", "aws_inferentia2"]),
                      roles=rng.choice([[], ["prefill"], ["decode"]]), gbps=rng.choice([10.0, 100.0, 400.0]),
                      cost_per_hour=rng.uniform(0.5, 5)) for i in range(6)]
        for v in nodes:
            v.outstanding = rng.randrange(0, 40)
            v.pending = min(v.outstanding, rng.randrange(0, 4))
        wholes = [v for v in nodes if not v.state.roles or "decode" in v.state.roles]
        if not wholes:
            continue
        kw = {"prompt": rng.randrange(100, 8000), "out": rng.randrange(1, 600), "objective": rng.choice(["latency", "cost"])}
        first = decide(nodes, wholes[0], **kw)
        second = decide(nodes, wholes[0], previous=first.mode, **kw)
        flips += first.split != second.split or first.chosen != second.chosen
    assert flips == 0


def test_prefill_only_nodes_never_serve_a_whole_request() -> None:
    p, d = view("p", roles=["prefill"]), busy(view("d", roles=["decode"]), 30)
    assert is_routable(p, "m", 0.0, 15.0) == "prefill_only"
    for nodes in ([p, d], [view(f"x{i}", roles=["prefill"]) for i in range(40)] + [d]):
        dec = choose_node(nodes, RouteRequest(model="m", prompt_tokens=100), builtin_policy("latency"), 0.0,
                          RoutingState())
        assert dec.node_id == "d"


def test_always_splits_when_a_pair_exists() -> None:
    p, d = view("p", gbps=0.5), busy(view("d", gbps=0.5))
    assert decide([p, d], d).reason == "whole_better"
    dec = decide([p, d], d, settings=SplitSettings(always=True))
    assert dec.split and dec.reason == "always" and dec.chosen is not None and dec.chosen.prefill_node == "p"
    assert decide([p, d], d, prompt=100, settings=SplitSettings(always=True)).reason == "short_prompt"


def test_the_index_decides_as_the_scan_does() -> None:
    """The index's vector search (a large fleet's fast path) against the pass over the nodes:
    the same decision, option for option, on random fleets built to tie (few kinds, small
    counters: equal keys are broken by node id in both), with roles, groups, dead links, link
    overrides, caches, exclusions, cooldowns, stale states, state changes after the index, and a
    decode node imposed (a failed prefill leg's search for another), and inter-token targets."""
    import msgspec

    from zmlcore.policy.split import SplitIndex

    rng = random.Random(11)
    kinds = ["nvidia_h100", "amd_mi300x", "intel_gaudi2", "aws_inferentia2", "nvidia_a100"]
    outcomes: dict[str, int] = {}
    for trial in range(160):
        n = rng.choice([17, 40, 120, 400])
        few = rng.random() < 0.5  # a fleet of two kinds and small counters: many exact ties
        nodes = [view(f"n{rng.randrange(10 * n)}-{i}", rng.choice(kinds[:2] if few else kinds),
                      roles=rng.choice([[], [], ["prefill"], ["decode"]]), group=rng.choice(["g", "g", "g", "h", ""]),
                      gbps=rng.choice([0.0, 10.0, 100.0, 400.0]),
                      cost_per_hour=rng.choice([2.0, 4.0]) if few else rng.uniform(0.5, 5),
                      updated_at=rng.choice([0.0, 0.0, 0.0, -30.0])) for i in range(n)]
        index = SplitIndex(nodes)
        for v in nodes:  # after the index: it follows the counters and the states
            v.outstanding = rng.randrange(0, 4 if few else 40)
            v.pending = min(v.outstanding, rng.randrange(0, 3))
            if rng.random() < 0.3:
                v.pending_tokens = float(rng.randrange(0, 9000))
            if rng.random() < 0.05:
                v.cooldown_until = rng.choice([-1.0, 5.0])
            if rng.random() < 0.05:
                v.state = msgspec.structs.replace(v.state, status=rng.choice(["up", "draining"]),
                                              models=rng.choice([["m"], ["other"]]), updated_at=0.0,
                                              kv_group=rng.choice(["g", "h", ""]))
        wholes = [v for v in nodes if "prefill" not in v.state.roles or "decode" in v.state.roles]
        prompt = rng.randrange(300, 8000)
        cached = {v.node_id: rng.randrange(0, prompt) for v in rng.sample(nodes, rng.choice([0, 1, 3]))}
        cached[wholes[0].node_id] = rng.randrange(0, 500)
        links = KVLinks({(rng.choice(nodes).node_id, rng.choice(nodes).node_id): rng.choice([1.0, 800.0])
                         for _ in range(rng.choice([0, 0, 20]))})
        kw = {"prompt": prompt, "out": rng.randrange(1, 600), "objective": rng.choice(["latency", "cost"]),
              "cached": cached, "links": links, "stale_after_s": 15.0,
              "latency_target_s": rng.choice([0.5, 2.0, 5.0]), "itl_target_s": rng.choice([float("inf"), 0.025, 0.05]),
              "exclude": frozenset(rng.choice(nodes).node_id for _ in range(rng.choice([0, 1, 5]))),
              "decode_node": rng.choice([None, None, None, wholes[0].node_id])}  # (a prefill leg's failover)
        a = decide(nodes, wholes[0], **kw)
        b = decide(nodes, wholes[0], index=index, **kw)
        assert (a.split, a.reason, a.chosen, a.best_split) == (b.split, b.reason, b.chosen, b.best_split), trial
        outcomes[a.reason] = outcomes.get(a.reason, 0) + 1
        index.close()
    # both outcomes, and searches with no pair, were compared
    assert outcomes.get("split_better", 0) > 10 and outcomes.get("whole_better", 0) > 10, outcomes


def test_a_failed_prefill_legs_search_keeps_its_decode_node() -> None:
    # another prefill node for the same decode node, though another decoder would now be better
    p1, p2 = view("p1", roles=["prefill"]), view("p2", "amd_mi300x", roles=["prefill"])
    d, idle = busy(view("d", "intel_gaudi2", roles=["decode"])), view("idle", roles=["decode"])
    assert decide([p1, p2, d, idle], d).chosen.node == "idle"  # type: ignore[union-attr]
    dec = decide([p1, p2, d, idle], d, exclude=frozenset({"p1"}), decode_node="d")
    assert dec.split and dec.chosen is not None and (dec.chosen.prefill_node, dec.chosen.node) == ("p2", "d")
    # no other prefill node: whole on it
    assert decide([p1, d, idle], d, exclude=frozenset({"p1"}), decode_node="d").reason == "no_pair"


def test_an_inter_token_target_splits_a_short_prompt_off_a_slow_decoder() -> None:
    """A request with an inter-token target whose node decodes slower than it (an Inferentia2:
    18 tokens/s, 56 ms a token) is split, however short its prompt: the prompt prefilled there
    (or elsewhere), its tokens decoded where they meet the target. Without the target, or on a
    node that meets it, a short prompt stays whole."""
    slow = view("inf2", "aws_inferentia2", prefill_tps=3000.0, decode_tps=18.0)
    fast = busy(view("h100", prefill_tps=10000.0, decode_tps=60.0), 4)
    assert decide([slow, fast], slow, prompt=60).reason == "short_prompt"
    dec = decide([slow, fast], slow, prompt=60, itl_target_s=0.05)
    assert dec.split and dec.chosen is not None and dec.chosen.node == "h100" and dec.chosen.itl_s <= 0.05
    assert dec.whole is not None and dec.whole.itl_s > 0.05
    assert decide([slow, fast], fast, prompt=60, itl_target_s=0.05).reason == "short_prompt"
    # the cost objective: an option past the target is late, as one past the TTFT target is
    cost = decide([slow, fast], slow, prompt=60, itl_target_s=0.05, objective="cost")
    assert cost.split and cost.chosen is not None and cost.chosen.node == "h100"
