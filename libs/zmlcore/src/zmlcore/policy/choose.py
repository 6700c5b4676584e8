"""choose_node: the routing decision. Pure: no I/O, ``now`` is passed in.

This first version implements candidate filtering, the error classification of the API
reference (MODEL_NOT_LOADED / NO_HEALTHY_NODES / QUEUE_FULL with a routing_context) and
round-robin selection; the other strategies build on the same filtering.
"""

from __future__ import annotations

from collections.abc import Sequence

from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError, QueueFullError, RoutingError
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import Decision, FamilyEval, NodeView, RouteRequest, RoutingState


def is_routable(view: NodeView, model: str, now: float, stale_after_s: float) -> str | None:
    """None if the node may take a request for ``model`` now, else the rejection reason."""
    st = view.state
    if st.status != "up":
        return "node_" + st.status
    if now - st.updated_at > stale_after_s:
        return "state_stale"
    if model not in st.models:
        return "model_loading" if model in st.loading_models else "model_not_loaded"
    if view.cooldown_until > now:
        return "cooldown"
    if view.saturated_until > now:
        return "saturated"
    return None


def queue_depth(view: NodeView) -> int:
    """Requests on the node as this router sees it: polled depth plus local outstanding."""
    return view.state.queue_running + view.state.queue_waiting + view.outstanding


def choose_node(
    nodes: Sequence[NodeView],
    req: RouteRequest,
    policy: ResolvedPolicy,
    now: float,
    state: RoutingState,
    *,
    stale_after_s: float = 15.0,
) -> Decision:
    serving = [v for v in nodes if req.model in v.state.models or req.model in v.state.loading_models]
    if req.accelerator_id is not None:
        pinned = [v for v in nodes if v.node_id == req.accelerator_id]
        if not pinned:
            raise RoutingError(f"accelerator_id {req.accelerator_id!r} is not a registered node")
        reason = is_routable(pinned[0], req.model, now, stale_after_s)
        if reason is not None or pinned[0].node_id in req.exclude:
            raise NoHealthyNodesError(
                f"node {req.accelerator_id!r} cannot take the request: {reason or 'failed'}",
                routing_context={"policy": "pinned", "final_error": reason or "failed"},
            )
        v = pinned[0]
        return Decision(v.node_id, v.state.family, "pinned", queue_depth(v))
    if not serving:
        raise ModelNotLoadedError(
            f"model {req.model!r} is not loaded on any available node; run `zml serve {req.model}`",
            routing_context={"policy": policy.name, "evaluated": [], "final_error": "model_not_loaded"},
        )
    families: list[str] = list(policy.chain) or list(dict.fromkeys(v.state.family for v in serving))
    evaluated: list[FamilyEval] = []
    candidates: list[NodeView] = []
    reasons: list[str] = []
    for fam in families:
        fam_nodes = [v for v in serving if v.state.family.lower() == fam.lower()]
        ok = []
        fam_reasons = []
        for v in fam_nodes:
            r = "excluded" if v.node_id in req.exclude else is_routable(v, req.model, now, stale_after_s)
            if r is None:
                ok.append(v)
            else:
                fam_reasons.append(r)
        reasons.extend(fam_reasons)
        evaluated.append(
            FamilyEval(fam, len(fam_nodes), None if ok else (_summarise(fam_reasons) if fam_nodes else "no_nodes"))
        )
        candidates.extend(ok)
    if not candidates:
        ctx = {
            "policy": policy.name,
            "evaluated": [e.as_dict() for e in evaluated],
            "final_error": "no_viable_node",
        }
        if reasons and all(r in ("saturated",) for r in reasons):
            ctx["recommendation"] = "increase fleet capacity or enable queue_on_saturation"
            raise QueueFullError(f"all nodes serving {req.model!r} are saturated", routing_context=ctx)
        if reasons and all(r in ("model_loading",) for r in reasons):
            raise ModelNotLoadedError(f"model {req.model!r} is still loading", routing_context=ctx)
        ctx["recommendation"] = "check node connectivity and driver status (`zml nodes`)"
        raise NoHealthyNodesError(f"no healthy node serves {req.model!r}", routing_context=ctx)
    idx = state.rr_cursor % len(candidates)
    state.rr_cursor += 1
    v = candidates[idx]
    return Decision(v.node_id, v.state.family, policy.name, queue_depth(v), evaluated=evaluated)


def _summarise(reasons: list[str]) -> str:
    if not reasons:
        return "no_nodes"
    if len(set(reasons)) == 1:
        return {"saturated": "all_nodes_over_capacity", "node_down": "health_check_failed"}.get(
            reasons[0], reasons[0]
        )
    return "mixed:" + ",".join(sorted(set(reasons)))
