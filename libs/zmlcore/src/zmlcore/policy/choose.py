"""choose_node: the routing decision. Pure: no I/O, ``now`` is passed in, the index is only read.

Flow: pinned ``accelerator_id`` bypasses the policy; otherwise the policy's strategy (one module
each under ``strategies/``) picks among the rows of the model's table (see
:class:`~zmlcore.policy.FleetIndex`): ``select`` over every routable row of a small table,
``select_rows``, the same pick in vector operations, over a large one (see ``context``). A
request with no routable node gets MODEL_NOT_LOADED / QUEUE_FULL / NO_HEALTHY_NODES with a
``routing_context``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NoReturn

import numpy as np

from zmlcore.errors import BadRequestError, ModelNotLoadedError, NoHealthyNodesError, QueueFullError
from zmlcore.policy.context import Cand, Ctx, VCtx
from zmlcore.policy.estimate import adapter_load_s
from zmlcore.policy.fleet import FleetIndex, ModelTable
from zmlcore.policy.prefix.index import Match, PrefixIndex, slot_array, slots_of
from zmlcore.policy.prefix.keys import KEY_ENDS
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.session import keep_bound
from zmlcore.policy.strategies import availability, chain, cost, latency, round_robin, weighted
from zmlcore.policy.types import Decision, FamilyEval, NodeView, RouteRequest, RoutingState

STRATEGIES: dict[str, Callable[[Ctx], Cand | None]] = {
    "latency": latency.select,
    "cost": cost.select,
    "availability": availability.select,
    "round_robin": round_robin.select,
    "weighted": weighted.select,
    "balanced": chain.select,
    "chain": chain.select,
}
#: The same picks over a large table, as row numbers (see zmlcore.policy.context).
ROW_STRATEGIES: dict[str, Callable[[VCtx], int | None]] = {
    "latency": latency.select_rows,
    "cost": cost.select_rows,
    "availability": availability.select_rows,
    "round_robin": round_robin.select_rows,
    "weighted": weighted.select_rows,
    "balanced": chain.select_rows,
    "chain": chain.select_rows,
}

#: Reasons that say "busy, retry soon" (QUEUE_FULL) rather than "broken" (NO_HEALTHY_NODES).
_BUSY = frozenset({"saturated", "cooldown"})


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
    if st.roles and "decode" not in st.roles:
        return "prefill_only"
    return None


def queue_depth(view: NodeView) -> int:
    """Requests on the node as this router sees it (local counters plus unseen polled load)."""
    return view.effective_outstanding()


def choose_node(
    nodes: Sequence[NodeView],
    req: RouteRequest,
    policy: ResolvedPolicy,
    now: float,
    state: RoutingState,
    *,
    stale_after_s: float = 15.0,
    cache: PrefixIndex | None = None,
) -> Decision:
    """Pick the node for one request, or raise a RoutingError subclass with a routing_context.

    With a ``cache`` index and the request's key chain (``req.prefix``), every node's estimate
    counts only the prompt tokens it does not hold (``zmlcore.policy.prefix``); with a bound
    session (``req.session_node``) the bound node is kept while it is within the load bound
    (``zmlcore.policy.session``).

    ``nodes`` is best a :class:`FleetIndex` the router keeps: a decision reads the model's
    rows (a few vector operations, or a short Python scan of a small table) and never changes
    what the index says; it only fills the index's caches (the model's table on first use, a
    chain's ranks). The index follows the NodeViews, whose counters the caller updates after
    dispatching. A plain sequence is indexed for this call (or, when the same list object
    comes back, once and cached in ``state``). The only state a decision writes is ``state``:
    the round-robin cursor and that cached index.

    >>> from zmlcore.messages import NodeState
    >>> from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState
    >>> from zmlcore.policy.resolve import builtin_policy
    >>> st = NodeState(node_id="h1", accelerator_type="nvidia_h100", family="H100",
    ...                endpoint="http://h1", status="up", models=["m"], updated_at=100.0)
    >>> choose_node([NodeView(st)], RouteRequest(model="m"), builtin_policy("latency"),
    ...             now=100.0, state=RoutingState()).node_id
    'h1'
    """
    if req.accelerator_id is not None:
        return _pinned(nodes, req, now, stale_after_s)
    if req.base is not None:
        return _for_adapter(nodes, req, policy, now, state, stale_after_s, cache)
    fleet = state.fleet
    if state.fleet_src is not nodes or len(fleet) != len(nodes):  # the router's list: its cached index
        fleet = nodes if isinstance(nodes, FleetIndex) else _index_for(nodes, state)
    table = fleet.table(req.model)
    if not table.flat:
        raise ModelNotLoadedError(
            f"model {req.model!r} is not loaded on any available node; run `zml serve {req.model}`",
            routing_context={
                "policy": policy.name,
                "evaluated": [],
                "final_error": "model_not_loaded",
                "recommendation": f"run `zml serve {req.model}` or add it to a node's models",
            },
        )
    cached = None
    warm: list[int] | None = None
    if cache is not None and req.prefix is not None and req.prefix.keys:
        match = cache.lookup(req.prefix, now)
        if match:
            warm = []
            cached = cached_rows(table, cache, match, req.prompt_tokens, warm)
    ctx = (Ctx if table.small else VCtx)(fleet, table, req, policy, now, state, stale_after_s, cached)
    ctx.warm_rows = warm
    session = ""
    i = -1  # the picked row and its estimate
    est = 0.0
    if req.session_node is not None:
        row, session = keep_bound(ctx, req.session_node)
        if row is not None:
            i, est = row, ctx.est(table.group_of[row], row)
    if i < 0:
        if isinstance(ctx, VCtx):
            row = ROW_STRATEGIES.get(policy.strategy, chain.select_rows)(ctx)
            if row is not None:
                i, est = row, ctx.row_est(row)
        else:
            pick = STRATEGIES.get(policy.strategy, chain.select)(ctx)
            if pick is not None:
                i, est = pick.i, pick.est
    if i < 0:
        _fail(fleet, table.families, req, policy, now, stale_after_s)
    v = table.views[i]
    return Decision(
        v.node_id,
        v.state.family,
        policy.name,
        v.effective_outstanding(),
        estimated_ttft_s=est,
        evaluated=ctx.evaluated or [],
        cached_tokens=ctx.cached_at(i),
        session=session,
    )


def _for_adapter(nodes: Sequence[NodeView], req: RouteRequest, policy: ResolvedPolicy, now: float,
                 state: RoutingState, stale_after_s: float, cache: PrefixIndex | None) -> Decision:
    """A request for a LoRA adapter (``req.base`` its base model): the policy's pick among the
    nodes holding it, or among the nodes serving its base whose engine loads it for the
    request, that pick's estimate plus the node's adapter load time (``adapter_load_s``),
    whichever is sooner; a tie goes to the node holding it. Neither: the holders' error
    (MODEL_NOT_LOADED when none holds it)."""
    held: Decision | None = None
    err: ModelNotLoadedError | NoHealthyNodesError | QueueFullError | None = None
    try:
        held = choose_node(nodes, replace(req, base=None), policy, now, state, stale_after_s=stale_after_s,
                           cache=cache)
    except (ModelNotLoadedError, NoHealthyNodesError, QueueFullError) as exc:
        err = exc
    fleet = state.fleet
    if state.fleet_src is not nodes or len(fleet) != len(nodes):
        fleet = nodes if isinstance(nodes, FleetIndex) else _index_for(nodes, state)
    base = req.base or ""
    views = fleet.table(base).views
    load: dict[str, float] = {}
    other: set[str] = set(req.exclude)
    for v in views:
        s = adapter_load_s(v.state, req.model)
        if s:
            load[v.node_id] = s
        else:
            other.add(v.node_id)  # holds it (the holders' pick above) or cannot load it
    if load:
        # the base's nodes that would load it; its cache keys are the adapter's, none held there
        try:
            pick = choose_node(fleet, RouteRequest(base, req.prompt_tokens, req.max_tokens, exclude=frozenset(other)),
                               policy, now, state, stale_after_s=stale_after_s)
        except (ModelNotLoadedError, NoHealthyNodesError, QueueFullError):
            pick = None
        if pick is not None:
            s = load[pick.node_id]
            if held is None or pick.estimated_ttft_s + s < held.estimated_ttft_s:
                pick.estimated_ttft_s += s
                pick.adapter_load_s = s
                return pick
    if held is not None:
        return held
    assert err is not None
    raise err


def cached_rows(table: ModelTable, cache: PrefixIndex, match: Match, prompt_tokens: int,
                warm: list[int] | None = None) -> Any:
    """Each row's cached tokens for this request, in whole blocks of its node's engine:
    ``{row: tokens}`` for a small table, a dense array for a large one (None: no row holds
    any). A node's tokens are the matched bytes in tokens, capped below the whole prompt
    (``PrefixIndex.to_tokens``), rounded down to its block size.

    Only the nodes of the match's groups are visited (the warm ones), never the whole fleet: a
    group of a few nodes bit by bit, a large one (a shared system prompt) in a few vector
    operations over its slots. Slots of nodes outside the table map to a spare last element,
    which the result leaves out. ``warm`` (a large table's), if given, receives the rows with
    cached tokens when every group was visited bit by bit, and is set to ``[-1]`` (unknown: read
    the array) when a group was written in a vector step."""
    key = (id(cache), cache.epoch)
    n = len(table.views)
    if table.slot_key != key:  # nodes joined/left the index or the table was rebuilt
        m = np.full(len(cache.block_by_slot), n, dtype=np.intp)
        for j, v in enumerate(table.views):
            nc = cache.node(v.node_id)
            if nc is not None:
                m[nc.slot] = j
        table.slot_rows = m
        table.slot_key = key
        table.base_rows = {}
    rows_of = table.slot_rows
    chain = match.chain
    bpt = cache.bytes_per_token
    total = max(prompt_tokens, chain.nbytes // bpt)
    n_slots = len(rows_of)
    small = table.small
    out: Any = {} if small else None
    hit = False
    groups = match.groups
    based = False
    if not small and len(groups) > 1 and match.held.bit_count() >= 8:
        # Many nodes usually hold a shared prefix (the base, the largest group) and a few hold
        # more of this prompt: every holder of the first key (the groups' union, whose slots
        # are remembered: ``PrefixIndex.slots``) is written with the base's tokens in one
        # vector operation, then the other groups over it.
        base = max(groups, key=lambda g: g[0].bit_count())
        if base[0].bit_count() >= 8:
            groups = [g for g in groups if g is not base]
            t = min(KEY_ENDS[base[1] - 1] // bpt, total - 1)
            if t > 0:
                tok, every = cache.tokens_by_slot(t)
                # the same holders and tokens come back request after request (a system
                # prompt's): their rows are remembered per table, copied (1 numpy call, not 4)
                hk = (match.held, t)
                br = table.base_rows.get(hk)
                if br is None or br[0] is not tok:  # (tok is renewed when a block size changes)
                    sa = cache.slots(match.held)
                    if match.held.bit_length() > n_slots:
                        sa = sa[sa < n_slots]
                    out = np.zeros(n + 1)
                    out[rows_of[sa]] = tok[sa]
                    if len(table.base_rows) >= 32:
                        table.base_rows.clear()
                    br = table.base_rows[hk] = (tok, out, every or bool(np.count_nonzero(out[:n])))
                out = br[1].copy()
                hit = br[2]
                based = True
                if warm is not None:
                    warm[:] = [-1]
                    warm = None
    for mask, nkeys in groups:
        t = min(KEY_ENDS[nkeys - 1] // bpt, total - 1)
        if t <= 0:
            if based:  # written with the base's tokens: this group holds no whole token
                sa = cache.slots(mask)
                out[rows_of[sa[sa < n_slots]]] = 0.0
            continue
        if small or mask.bit_count() < 8:
            blocks = cache.block_by_slot
            for sl in slots_of(mask):
                if sl >= n_slots:
                    continue
                j = rows_of.item(sl)
                if j == n:
                    continue
                b = blocks.item(sl)
                c = t // b * b  # (tokens_by_slot's value for one slot)
                if out is None:
                    if not c:
                        continue
                    out = np.zeros(n + 1)
                if small:
                    if c:
                        out[j] = c
                        hit = True
                else:
                    out[j] = c
                    if c > 0:
                        hit = True
                        if warm is not None:
                            warm.append(j)
        else:  # a prefix many nodes hold: vector work
            tok, every = cache.tokens_by_slot(t)  # t in whole blocks of each slot's engine
            sa = cache.slots(mask)
            if mask.bit_length() > n_slots:
                sa = sa[sa < n_slots]
            c = tok[sa]
            if out is None:
                out = np.zeros(n + 1)
            out[rows_of[sa]] = c
            hit = hit or every or bool(np.count_nonzero(c))
            if warm is not None:
                warm[:] = [-1]
                warm = None
    if small:
        return out or None
    return out[:n] if hit else None


def _index_for(nodes: Sequence[NodeView], state: RoutingState) -> FleetIndex:
    """An index for a plain list: cached in ``state`` when the router reuses the list object
    (a watching index follows every counter change, so it stays exact)."""
    cached: FleetIndex | None = state.fleet
    if cached is not None and state.fleet_src is nodes and len(cached) == len(nodes):
        return cached
    if state.last_list is nodes:
        if cached is not None:
            cached.close()
        fleet = FleetIndex(nodes)
        state.fleet = fleet
        state.fleet_src = nodes
        return fleet
    state.last_list = nodes
    return FleetIndex(nodes, watch=False)


def _pinned(nodes: Sequence[NodeView], req: RouteRequest, now: float, stale_after_s: float) -> Decision:
    if isinstance(nodes, FleetIndex):
        v = nodes.get(req.accelerator_id or "")
    else:
        v = next((n for n in nodes if n.node_id == req.accelerator_id), None)
    if v is None:
        raise BadRequestError(
            f"accelerator_id {req.accelerator_id!r} is not a registered node (see `zml nodes`)",
            routing_context={"policy": "pinned", "evaluated": [], "final_error": "unknown_node"},
        )
    reason = "excluded" if v.node_id in req.exclude else is_routable(v, req.model, now, stale_after_s)
    if reason is not None:
        ctx = {
            "policy": "pinned",
            "evaluated": [{"family": v.state.family, "nodes_checked": 1, "rejected_reason": reason}],
            "final_error": reason,
            "recommendation": "retry without accelerator_id or pick another node (`zml nodes`)",
        }
        if reason in ("model_loading", "model_not_loaded"):
            raise ModelNotLoadedError(f"model {req.model!r} is not loaded on node {v.node_id!r}", routing_context=ctx)
        if reason in _BUSY:
            raise QueueFullError(f"node {v.node_id!r} is {reason}", routing_context=ctx)
        raise NoHealthyNodesError(f"node {v.node_id!r} cannot take the request: {reason}", routing_context=ctx)
    return Decision(v.node_id, v.state.family, "pinned", v.effective_outstanding())


def _fail(
    nodes: Sequence[NodeView],
    registered: list[str],
    req: RouteRequest,
    policy: ResolvedPolicy,
    now: float,
    stale_after_s: float,
) -> NoReturn:
    """The slow path: re-check every node to say exactly why nothing was routable."""
    families = list(policy.chain) or registered
    evaluated: list[dict[str, Any]] = []
    reasons: list[str] = []
    for fam in families:
        fam_nodes = [
            v for v in nodes
            if v.state.family.lower() == fam.lower()
            and (req.model in v.state.models or req.model in v.state.loading_models)
        ]
        fam_reasons = [
            "excluded" if v.node_id in req.exclude else (is_routable(v, req.model, now, stale_after_s) or "health_score_below_threshold")
            for v in fam_nodes
        ]
        reasons.extend(fam_reasons)
        evaluated.append(FamilyEval(fam, len(fam_nodes), _summarise(fam_reasons)).as_dict())
    ctx: dict[str, Any] = {"policy": policy.name, "evaluated": evaluated, "final_error": "no_viable_node"}
    if reasons and all(r in _BUSY for r in reasons) and "saturated" in reasons:
        ctx["recommendation"] = "increase fleet capacity or enable queue_on_saturation"
        raise QueueFullError(f"all nodes serving {req.model!r} are over capacity", routing_context=ctx)
    if reasons and all(r in ("model_loading", "excluded") for r in reasons) and "model_loading" in reasons:
        ctx["final_error"] = "model_loading"
        ctx["recommendation"] = "retry when the model has loaded (`zml nodes` shows progress)"
        raise ModelNotLoadedError(f"model {req.model!r} is still loading", routing_context=ctx)
    if not reasons:
        ctx["final_error"] = "no_nodes_in_chain"
        ctx["recommendation"] = f"add a family that serves {req.model!r} to the policy's accelerator_chain"
        raise NoHealthyNodesError(f"no node of policy {policy.name!r}'s families serves {req.model!r}", routing_context=ctx)
    ctx["recommendation"] = "check node connectivity and driver status (`zml nodes`)"
    raise NoHealthyNodesError(f"no healthy node serves {req.model!r}", routing_context=ctx)


def _summarise(reasons: list[str]) -> str:
    if not reasons:
        return "no_nodes"
    if len(set(reasons)) == 1:
        return {
            "saturated": "all_nodes_over_capacity",
            "node_down": "health_check_failed",
            "cooldown": "all_nodes_cooling_down",
        }.get(reasons[0], reasons[0])
    return "mixed:" + ",".join(sorted(set(reasons)))
