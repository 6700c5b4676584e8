"""An adapter's request (issue 32 item 3): it prefers a node holding the adapter, and costs the
adapter's load time in the estimate of a node that would load it for the request (vLLM with a
LoRA resolver, ``adapters_on_request``). Pure: zmlcore.policy, as the router and the placement
day (benches/placement_day.py) call it."""

from __future__ import annotations

import pytest

from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState, admit, choose_node
from zmlcore.policy.estimate import DEFAULT_ADAPTER_LOAD_S, adapter_load_s
from zmlcore.policy.resolve import builtin_policy

NOW = 1_000.0
LATENCY = builtin_policy("latency")


def _node(node_id: str, *, adapters: tuple[str, ...] = (), on_request: bool = True, slots: int = 4,
          load_s: float = 0.0) -> NodeView:
    return NodeView(NodeState(node_id=node_id, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                              backend="vllm", status="up", models=["base", *adapters], adapters=list(adapters),
                              adapters_on_request=on_request, adapter_slots=slots, adapter_load_s=load_s,
                              max_concurrency=8, updated_at=NOW))


def _req(**kw: object) -> RouteRequest:
    return RouteRequest(model="tuned", prompt_tokens=1000, base="base", **kw)  # type: ignore[arg-type]


def _choose(nodes: list[NodeView], rr: RouteRequest, policy: str = "latency") -> object:
    return choose_node(nodes, rr, builtin_policy(policy), NOW, RoutingState())


def test_an_idle_node_holding_the_adapter_wins_over_an_idle_one_that_would_load_it() -> None:
    nodes = [_node("loader"), _node("holder", adapters=("tuned",))]
    d = _choose(nodes, _req())
    assert d.node_id == "holder" and d.adapter_load_s == 0.0  # type: ignore[attr-defined]


def test_a_holder_queued_longer_than_the_load_loses_to_a_node_that_loads_it() -> None:
    nodes = [_node("loader"), _node("holder", adapters=("tuned",))]
    nodes[1].set_counts(20, 6)  # 6 prefills queued and every slot taken: seconds of wait
    held = estimate_of(nodes[1])
    d = _choose(nodes, _req())
    assert held > DEFAULT_ADAPTER_LOAD_S["vllm"] + 0.1
    assert d.node_id == "loader"  # type: ignore[attr-defined]
    assert d.adapter_load_s == DEFAULT_ADAPTER_LOAD_S["vllm"]  # type: ignore[attr-defined]
    assert d.estimated_ttft_s == pytest.approx(0.1 + DEFAULT_ADAPTER_LOAD_S["vllm"], abs=0.01)  # type: ignore[attr-defined]


def estimate_of(v: NodeView) -> float:
    return choose_node([v], RouteRequest(model="tuned", prompt_tokens=1000), LATENCY, NOW, RoutingState()).estimated_ttft_s


def test_the_nodes_measured_load_time_is_what_the_estimate_costs() -> None:
    """A node whose loads were measured slow keeps the queued holder (a few s) ahead of it."""
    nodes = [_node("loader", load_s=8.0), _node("holder", adapters=("tuned",))]
    nodes[1].set_counts(10, 3)
    assert 1.0 < estimate_of(nodes[1]) < 8.0
    assert _choose(nodes, _req()).node_id == "holder"  # type: ignore[attr-defined]
    nodes[0] = _node("loader", load_s=0.2)
    d = _choose(nodes, _req())
    assert d.node_id == "loader" and d.adapter_load_s == 0.2  # type: ignore[attr-defined]


def test_held_nowhere_it_goes_where_it_loads_instead_of_being_refused() -> None:
    d = _choose([_node("a", on_request=False), _node("b")], _req())
    assert d.node_id == "b" and d.adapter_load_s > 0  # type: ignore[attr-defined]


def test_no_node_holds_or_loads_it_on_request_model_not_loaded_as_before() -> None:
    with pytest.raises(ModelNotLoadedError):
        _choose([_node("a", on_request=False), _node("b", adapters=("other",), slots=1)], _req())


def test_a_node_whose_adapter_slots_are_full_does_not_load_another() -> None:
    full = _node("full", adapters=("x", "y"), slots=2)
    assert adapter_load_s(full.state, "tuned") is None
    assert adapter_load_s(full.state, "x") == 0.0
    assert _choose([full, _node("free")], _req()).node_id == "free"  # type: ignore[attr-defined]


def test_other_policies_prefer_the_holder_and_excluded_nodes_stay_excluded() -> None:
    nodes = [_node("loader"), _node("holder", adapters=("tuned",))]
    for policy in ("round_robin", "cost", "availability"):
        assert _choose(nodes, _req(), policy).node_id == "holder"  # type: ignore[attr-defined]
    d = _choose(nodes, _req(exclude=frozenset({"holder"})))
    assert d.node_id == "loader"  # type: ignore[attr-defined]
    with pytest.raises(NoHealthyNodesError):  # the holders' error, as for any model
        _choose(nodes, _req(exclude=frozenset({"holder", "loader"})))


def test_admission_bounds_the_estimate_with_the_load_in_it() -> None:
    d = admit([_node("loader", load_s=0.5)], _req(), LATENCY, NOW, RoutingState(), stale_after_s=15.0,
              ttft_bound_s=30.0)
    assert d.node_id == "loader" and d.estimated_ttft_s >= 0.5
    with pytest.raises(Exception) as exc:
        admit([_node("loader", load_s=50.0)], _req(), LATENCY, NOW, RoutingState(), stale_after_s=15.0,
              ttft_bound_s=30.0)
    assert getattr(exc.value, "code", "") == "QUEUE_FULL"
