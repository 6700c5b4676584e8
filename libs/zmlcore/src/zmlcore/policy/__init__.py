"""Routing policy maths: pure functions, time passed in, no I/O.

    decision = choose_node(nodes, RouteRequest(model="m"), resolved_policy, now, state)
"""

from zmlcore.policy.choose import choose_node, is_routable
from zmlcore.policy.resolve import ResolvedPolicy, resolve_policy
from zmlcore.policy.types import Decision, FamilyEval, NodeView, RouteRequest, RoutingState

__all__ = [
    "Decision",
    "FamilyEval",
    "NodeView",
    "ResolvedPolicy",
    "RouteRequest",
    "RoutingState",
    "choose_node",
    "is_routable",
    "resolve_policy",
]
