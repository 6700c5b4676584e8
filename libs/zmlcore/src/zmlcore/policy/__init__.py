"""Routing policy maths: pure functions, time passed in, no I/O.

    fleet = FleetIndex(views)                       # the router keeps one, rebuilt on membership change
    decision = choose_node(fleet, RouteRequest(model="m", prompt_tokens=700), resolved_policy, now, state)

Modules: ``types`` (NodeView, RouteRequest, Decision...), ``estimate`` (TTFT estimate),
``fleet`` (FleetIndex), ``resolve`` (policy resolution and validation), ``choose``
(choose_node), ``admission`` (admit: choose_node under the admission bound, with a half-open
breaker: the decision a router acts on), ``strategies/`` (one module per strategy). See
docs/routing.md.
"""

from zmlcore.policy.admission import admit
from zmlcore.policy.choose import choose_node, is_routable, queue_depth
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, estimate_ttft
from zmlcore.policy.fleet import FleetIndex
from zmlcore.policy.resolve import ResolvedPolicy, builtin_policy, check_policy, make_policy, resolve_policy
from zmlcore.policy.types import Decision, FamilyEval, NodeView, RouteRequest, RoutingState

__all__ = [
    "MEAN_OUTPUT_TOKENS",
    "MEAN_PROMPT_TOKENS",
    "Decision",
    "FamilyEval",
    "FleetIndex",
    "NodeView",
    "ResolvedPolicy",
    "RouteRequest",
    "RoutingState",
    "admit",
    "builtin_policy",
    "check_policy",
    "choose_node",
    "estimate_ttft",
    "is_routable",
    "make_policy",
    "queue_depth",
    "resolve_policy",
]
