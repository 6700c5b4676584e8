"""The decision a router acts on: :func:`~zmlcore.policy.choose_node`, bounded by the estimated
time to first token (the admission bound, ``[router] admission_ttft_s``), with a half-open
breaker for a fleet that is all cooling down. Pure: no I/O, ``now`` is passed in.

    decision = admit(table.nodes(), rr, policy, now, state, stale_after_s=15.0, ttft_bound_s=60.0)

``choose_node`` says which node a policy prefers; ``admit`` says whether the request may go at
all: a pick whose estimated TTFT is over the bound falls back to the fastest node, and when even
that one is over it the fleet is saturated for the request (QUEUE_FULL, which a policy with
``queue_on_saturation`` turns into a wait in the saturation queue).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from zmlcore.errors import NoHealthyNodesError, QueueFullError
from zmlcore.policy.choose import choose_node, is_routable
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.policy.resolve import ResolvedPolicy, builtin_policy
from zmlcore.policy.types import Decision, NodeView, RouteRequest, RoutingState

log = logging.getLogger("zml.policy")

_LATENCY = builtin_policy("latency")


def admit(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float, state: RoutingState,
          *, stale_after_s: float, ttft_bound_s: float, cache: PrefixIndex | None = None) -> Decision:
    """choose_node plus the admission bound; QueueFullError when every node is over it. A
    pinned request (``accelerator_id``) is not bounded: it cannot go anywhere else.

    >>> from zmlcore.messages import NodeState
    >>> from zmlcore.policy import NodeView
    >>> st = NodeState(node_id="h1", accelerator_type="nvidia_h100", family="H100",
    ...                endpoint="http://h1", status="up", models=["m"], updated_at=100.0)
    >>> admit([NodeView(st)], RouteRequest(model="m"), builtin_policy("latency"), 100.0, RoutingState(),
    ...       stale_after_s=15.0, ttft_bound_s=60.0).node_id
    'h1'
    """
    try:
        decision = choose_node(nodes, rr, policy, now, state, stale_after_s=stale_after_s, cache=cache)
    except (NoHealthyNodesError, QueueFullError):
        if not half_open(nodes, rr, now, stale_after_s):
            raise
        decision = choose_node(nodes, rr, policy, now, state, stale_after_s=stale_after_s, cache=cache)
    if decision.estimated_ttft_s <= ttft_bound_s or rr.accelerator_id is not None:
        return decision
    # The policy's pick is over the bound; is any node under it? The latency policy's
    # pick has the smallest estimate of all.
    fastest = choose_node(nodes, rr, _LATENCY, now, state, stale_after_s=stale_after_s, cache=cache)
    if fastest.estimated_ttft_s <= ttft_bound_s:
        return fastest
    raise QueueFullError(
        f"every node serving {rr.model!r} is saturated (best estimated time to first token "
        f"{fastest.estimated_ttft_s:.1f} s > admission bound {ttft_bound_s:g} s)",
        routing_context={
            "policy": policy.name,
            "evaluated": [e.as_dict() for e in decision.evaluated],
            "final_error": "all_nodes_over_capacity",
            "best_estimated_ttft_s": round(fastest.estimated_ttft_s, 3),
            "recommendation": "increase fleet capacity or enable queue_on_saturation",
        },
        retry_after=1.0,
    )


def half_open(nodes: Sequence[NodeView], rr: RouteRequest, now: float, stale_after_s: float) -> bool:
    """Every node that could serve is cooling down after failures: rather than refuse the
    request, give the node whose cooldown ends first one more chance (a half-open circuit
    breaker: its ``cooldown_until`` is cleared, the one change this module makes to a view). A
    failure puts it straight back. This stops a burst of failures on a starved host from taking
    the whole fleet out for ``cooldown_s``. Local to the caller's views: a router's peers keep
    their marks (zml_router.replicas.cooldowns)."""
    cooling = [v for v in nodes
               if v.node_id not in rr.exclude and is_routable(v, rr.model, now, stale_after_s) == "cooldown"
               and (rr.accelerator_id is None or v.node_id == rr.accelerator_id)]
    if not cooling:
        return False
    v = min(cooling, key=lambda v: v.cooldown_until)
    log.warning("every node for %s is cooling down; trying %s again early", rr.model, v.node_id)
    v.cooldown_until = 0.0
    return True
