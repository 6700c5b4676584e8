"""Admission: choose_node on the local table, bounded by the estimated time to first token,
with a half-open breaker for a fleet that is all cooling down. Pure maths on the router's own
table (no network); ``now`` is the only clock.
"""

from __future__ import annotations

import logging
import time

from zmlcore.config import RouterConfig
from zmlcore.errors import NoHealthyNodesError, QueueFullError
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest, RoutingState, choose_node, is_routable
from zmlcore.policy.resolve import builtin_policy

from zml_router.table import NodeTable

log = logging.getLogger("zml.router")

_LATENCY = builtin_policy("latency")


class Admission:
    def __init__(self, rc: RouterConfig, table: NodeTable, state: RoutingState) -> None:
        self.rc = rc
        self.table = table
        self.state = state

    def decide(self, rr: RouteRequest, policy: ResolvedPolicy, now: float | None = None) -> Decision:
        """choose_node plus the admission bound; QueueFullError when every node is over it."""
        now = time.time() if now is None else now
        rc = self.rc
        try:
            decision = choose_node(self.table.nodes(), rr, policy, now, self.state, stale_after_s=rc.stale_after_s)
        except (NoHealthyNodesError, QueueFullError):
            if not self.half_open(rr, now):
                raise
            decision = choose_node(self.table.nodes(), rr, policy, now, self.state, stale_after_s=rc.stale_after_s)
        if decision.estimated_ttft_s <= rc.admission_ttft_s or rr.accelerator_id is not None:
            return decision
        # The policy's pick is over the bound; is any node under it? The latency policy's
        # pick has the smallest estimate of all.
        fastest = choose_node(self.table.nodes(), rr, _LATENCY, now, self.state, stale_after_s=rc.stale_after_s)
        if fastest.estimated_ttft_s <= rc.admission_ttft_s:
            return fastest
        raise QueueFullError(
            f"every node serving {rr.model!r} is saturated (best estimated time to first token "
            f"{fastest.estimated_ttft_s:.1f} s > admission bound {rc.admission_ttft_s:g} s)",
            routing_context={
                "policy": policy.name,
                "evaluated": [e.as_dict() for e in decision.evaluated],
                "final_error": "all_nodes_over_capacity",
                "best_estimated_ttft_s": round(fastest.estimated_ttft_s, 3),
                "recommendation": "increase fleet capacity or enable queue_on_saturation",
            },
            retry_after=1.0,
        )

    def half_open(self, rr: RouteRequest, now: float) -> bool:
        """Every node that could serve is cooling down after failures: rather than refuse the
        request, give the node whose cooldown ends first one more chance (a half-open circuit
        breaker). A failure puts it straight back. This stops a burst of failures on a starved
        host from taking the whole fleet out for ``cooldown_s``. Local to this replica: the
        peers' marks stay (zml_router.cooldowns)."""
        stale = self.rc.stale_after_s
        cooling = [v for v in self.table.nodes()
                   if v.node_id not in rr.exclude and is_routable(v, rr.model, now, stale) == "cooldown"
                   and (rr.accelerator_id is None or v.node_id == rr.accelerator_id)]
        if not cooling:
            return False
        v = min(cooling, key=lambda v: v.cooldown_until)
        log.warning("every node for %s is cooling down; trying %s again early", rr.model, v.node_id)
        v.cooldown_until = 0.0
        return True
