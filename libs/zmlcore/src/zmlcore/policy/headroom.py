"""Batch priority: a request sent with ``Zml-Priority: batch`` (the batch runners' lines) is
admitted only where a node has headroom, so that batch work fills idle capacity and never
takes what interactive traffic needs. Pure: no I/O, ``now`` is passed in.

A node has headroom for one more batch request when, after it, ``reserve`` of its sequence
slots are still free (``[router] batch_reserve``, at least one slot when the share is not 0):
interactive arrivals find a slot at once instead of waiting for a batch sequence to end. The
counts are the router's own (every replica's dispatches, shared) plus what the last poll saw
beyond them, the same effective counts the TTFT estimate uses.

Nodes without headroom are left out of the policy's choice; when that leaves no node, the
answer is QUEUE_FULL with a short Retry-After, which the runner reads as "no room now" (it
waits, it does not fail). Prefill is not reserved: batch prefills waiting on a node raise its
estimated time to first token, so the interactive policies send new requests elsewhere (that
estimate counts every request waiting for prefill). A rule "nothing waits for prefill" was
tried: it let one batch prefill into a node at a time, so a burst of lines spread over every
node, expensive ones included, instead of filling the cheapest (docs/batches.md).

    decision = admit_batch(nodes, rr, policy, now, state, stale_after_s=15.0, reserve=0.25)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from zmlcore.errors import NoHealthyNodesError, QueueFullError
from zmlcore.policy.choose import choose_node, is_routable
from zmlcore.policy.estimate import node_speeds
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import Decision, NodeView, RouteRequest, RoutingState

#: Retry-After of a refusal for want of headroom: a slot frees within a line's time, often sooner.
NO_HEADROOM_RETRY_S = 0.2


def reserved_slots(max_concurrency: int, reserve: float) -> int:
    """Slots of a node batch work leaves free: ``reserve`` of them, at least one (0: none)."""
    return 0 if reserve <= 0 else max(1, math.ceil(max_concurrency * reserve))


def has_headroom(view: NodeView, reserve: float) -> bool:
    """May one more batch request start on this node now?"""
    _, _, maxc = node_speeds(view.state)
    return view.effective_outstanding() + 1 + reserved_slots(maxc, reserve) <= maxc


def admit_batch(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float,
                state: RoutingState, *, stale_after_s: float, reserve: float) -> Decision:
    """The policy's choice among the nodes with headroom; QueueFullError (retry shortly) when a
    node could serve the request but none has room to spare.

    >>> from zmlcore.messages import NodeState
    >>> from zmlcore.policy.resolve import builtin_policy
    >>> st = NodeState(node_id="h1", accelerator_type="nvidia_h100", family="H100", endpoint="http://h1",
    ...                status="up", models=["m"], max_concurrency=4, updated_at=100.0)
    >>> v = NodeView(st, outstanding=2)
    >>> admit_batch([v], RouteRequest(model="m"), builtin_policy("cost"), 100.0, RoutingState(),
    ...             stale_after_s=15.0, reserve=0.25).node_id
    'h1'
    >>> v.outstanding = 3   # 3 + 1 would leave no slot of the reserved one free
    >>> admit_batch([v], RouteRequest(model="m"), builtin_policy("cost"), 100.0, RoutingState(),
    ...             stale_after_s=15.0, reserve=0.25)
    Traceback (most recent call last):
    ...
    zmlcore.errors.QueueFullError: [QUEUE_FULL] no node serving 'm' has headroom for batch work now (1 busy)...
    """
    full = frozenset(v.node_id for v in nodes if v.node_id not in rr.exclude and not has_headroom(v, reserve))
    try:
        return choose_node(nodes, dataclasses.replace(rr, exclude=rr.exclude | full), policy, now, state,
                           stale_after_s=stale_after_s)
    except (NoHealthyNodesError, QueueFullError):
        busy = [v for v in nodes if v.node_id in full and is_routable(v, rr.model, now, stale_after_s) is None
                and (rr.accelerator_id is None or v.node_id == rr.accelerator_id)]
        if not busy:
            raise  # not a matter of room: down, stale, unknown model... as for any request
        raise QueueFullError(
            f"no node serving {rr.model!r} has headroom for batch work now ({len(busy)} busy); "
            "batch requests wait for idle capacity",
            routing_context={"policy": policy.name, "final_error": "no_headroom",
                             "nodes_busy": sorted(v.node_id for v in busy),
                             "recommendation": "retry after the Retry-After (batch work yields to interactive load)"},
            retry_after=NO_HEADROOM_RETRY_S,
        ) from None
