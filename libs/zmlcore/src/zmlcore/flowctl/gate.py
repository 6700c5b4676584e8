"""The router's decision for a request under flow control: which node, or wait, or refuse.
Pure: no I/O, ``now`` is passed in; the router and the flow simulator (benches/flow_sim.py) call it.

    decision, verdict = admit_flow(nodes, rr, policy, now, state, ask, over_share=False, flow=cfg.flow,
                                   stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1)

- ``batch``: only where a node has headroom beyond ``reserve`` (zmlcore.policy.headroom), as today;
- with ``[flow] hold_when_full``: a node without a free sequence slot takes nothing more, so the
  request waits in the saturation queue (QUEUE_FULL here), where the queue's order
  (zmlcore.flowctl.order) lets higher bands and tenants under their share go first. A tenant
  over its fair share, or a ``sheddable`` request, also leaves ``reserve`` of each node's slots
  free: the next request of an under-share tenant, or a higher band, finds a slot at once
  instead of waiting for one to free;
- a request with latency targets: zmlcore.flowctl.slo.admit_slo (the pick that meets them, or
  SLO_UNATTAINABLE at once);
- anything else: zmlcore.policy.admission.admit, exactly as without flow control.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from zmlcore.config import FlowConfig
from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError, QueueFullError
from zmlcore.flowctl.ask import Ask
from zmlcore.flowctl.bands import BATCH, SHEDDABLE
from zmlcore.flowctl.slo import SloVerdict, admit_slo
from zmlcore.policy import admission
from zmlcore.policy.choose import is_routable
from zmlcore.policy.estimate import node_speeds
from zmlcore.policy.headroom import admit_batch, reserved_slots
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import Decision, NodeView, RouteRequest, RoutingState

#: Retry-After of "no free slot": one frees within a request's decode, usually far sooner.
NO_SLOT_RETRY_S = 0.2


def free_slots(view: NodeView) -> int:
    """Sequence slots of the node nobody holds (the router's counts plus what its poll saw)."""
    _, _, maxc = node_speeds(view.state)
    return maxc - view.effective_outstanding()


def full_nodes(nodes: Sequence[NodeView], keep: float) -> frozenset[str]:
    """Nodes that would have fewer than ``reserved_slots(maxc, keep)`` slots free after one more
    request (``keep`` 0: nodes with no free slot)."""
    out = []
    for v in nodes:
        maxc = node_speeds(v.state)[2]
        if v.effective_outstanding() + 1 + (reserved_slots(maxc, keep) if keep > 0 else 0) > maxc:
            out.append(v.node_id)
    return frozenset(out)


def admit_flow(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float, state: RoutingState,
               ask: Ask, *, over_share: bool, flow: FlowConfig, stale_after_s: float, ttft_bound_s: float,
               reserve: float, cache: PrefixIndex | None = None) -> tuple[Decision, SloVerdict | None]:
    """The decision (and SLO verdict, when the request has targets) for ``ask``; QueueFullError
    when it must wait, SloUnattainableError when no node can meet its targets."""
    if ask.band == BATCH:
        return admit_batch(nodes, rr, policy, now, state, stale_after_s=stale_after_s, reserve=reserve), None
    full: frozenset[str] = frozenset()
    if flow.hold_when_full and rr.accelerator_id is None:
        keep = reserve if (over_share or ask.band >= SHEDDABLE) else 0.0
        full = full_nodes(nodes, keep) - rr.exclude
        if full:
            rr = dataclasses.replace(rr, exclude=rr.exclude | full)
    try:
        if ask.slo is not None:
            return admit_slo(nodes, rr, policy, now, state, ask.slo, stale_after_s=stale_after_s,
                             ttft_bound_s=ttft_bound_s, cache=cache)
        return admission.admit(nodes, rr, policy, now, state, stale_after_s=stale_after_s,
                               ttft_bound_s=ttft_bound_s, cache=cache), None
    except (NoHealthyNodesError, ModelNotLoadedError):
        busy = [v.node_id for v in nodes if v.node_id in full and is_routable(v, rr.model, now, stale_after_s) is None]
        if not busy:
            raise
        raise QueueFullError(
            f"every node serving {rr.model!r} has its sequence slots taken ({len(busy)} busy): "
            "the request waits for the next free slot in the saturation queue",
            routing_context={"policy": policy.name, "final_error": "no_free_slot", "nodes_busy": sorted(busy),
                             "recommendation": "enable queue_on_saturation on the policy, or retry shortly"},
            retry_after=NO_SLOT_RETRY_S,
        ) from None
