"""A price of 0 is a price (issue 10 item 7): a free node is free, not its type's list price."""

from __future__ import annotations

from test_policy_helpers import NOW, fleet5, node

from zmlcore.fleet.costs import CostTable
from zmlcore.messages import CostEntry
from zmlcore.policy import RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.estimate import node_cost


def test_zero_is_a_price() -> None:
    assert node_cost(node("h", "nvidia_h100", cost=0.0).state) == 0.0
    assert node_cost(node("h", "nvidia_h100").state) == 4.0


def test_cost_policy_picks_the_free_node() -> None:
    # Idle, the cost policy picks MI300X (cheapest per capacity); a free A100 beats every price.
    fleet = fleet5()
    assert choose_node(fleet, RouteRequest(model="m", prompt_tokens=100), builtin_policy("cost"), NOW,
                       RoutingState()).node_id == "mi300x"
    fleet[1] = node("a100", "nvidia_a100", cost=0.0)
    assert choose_node(fleet, RouteRequest(model="m", prompt_tokens=100), builtin_policy("cost"), NOW,
                       RoutingState()).node_id == "a100"


def test_run_time_price_of_zero_applies() -> None:
    table = CostTable()
    table.entries["h"] = CostEntry(cost_per_hour=0.0, source="manual", updated_at=1.0)
    assert node_cost(table.apply(node("h", "nvidia_h100").state)) == 0.0
