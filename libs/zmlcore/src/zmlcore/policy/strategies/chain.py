"""Policy chains (``accelerator_chain`` / ``accelerator_preference`` + ``cost_priority``).

* ``latency``: no cost evaluation. Walk the families in chain order and take the fastest node
  of the first family whose estimated TTFT is within ``latency_target_ms``; if none is, the
  fastest node overall.
* ``cost``: cost evaluation weighted by the latency target. Candidates in order of cost per
  unit of capacity (chain order breaks ties); take the first whose estimate is within the
  target, so an overloaded cheap family gives way to the next, dearer one. None within: fastest.
* ``balanced`` (the account default): among candidates within half the target, minimise
  ``est/target + cost/cheapest`` (equal weights); none within: the ``cost`` rule with the full
  target; none within that either: fastest.
"""

from __future__ import annotations

from zmlcore.policy.context import Cand, Ctx, VCtx, fastest
from zmlcore.policy.estimate import INF
from zmlcore.policy.strategies.cost import cheapest_within, cheapest_within_rows
from zmlcore.policy.strategies.weighted import weighted_pick, weighted_rows
from zmlcore.policy.types import FamilyEval

BALANCED_FRACTION = 0.5


def select(ctx: Ctx) -> Cand | None:
    prio = ctx.policy.config.cost_priority or "balanced"
    cands = ctx.candidates()
    target = ctx.target_s
    qt = ctx.policy.config.queue_threshold
    if prio == "latency":
        for rank in range(len(ctx.families)):
            fam = [c for c in cands if c.rank == rank]
            best = fastest(fam)
            if best is not None and best.est <= target and (qt is None or best.depth <= qt):
                return best
            if ctx.evaluated is not None and fam and not ctx.evaluated[rank].rejected_reason:
                ctx.evaluated[rank] = _exceeded(ctx.evaluated[rank])
        return fastest(cands)
    if prio == "cost":
        return cheapest_within(cands, target, qt) or fastest(cands)
    near = [c for c in cands if c.est <= target * BALANCED_FRACTION and (qt is None or c.depth <= qt)]
    if near:
        return weighted_pick(near, 1.0, 1.0, target)
    return cheapest_within(cands, target, qt) or fastest(cands)


def _exceeded(e: FamilyEval) -> FamilyEval:
    """``e`` rejected for its latency (a new entry: VCtx's entries are shared, Chain.evaluation)."""
    return FamilyEval(e.family, e.nodes_checked, "latency_target_exceeded")


def select_rows(ctx: VCtx) -> int | None:
    """:func:`select` over every row."""
    ctx.evaluate()
    prio = ctx.policy.config.cost_priority or "balanced"
    e = ctx.estimates()
    target = ctx.target_s
    qt = ctx.policy.config.queue_threshold
    if prio == "latency":
        depth = ctx.table.depth
        evaluated = ctx.evaluated
        assert evaluated is not None
        for rank, (_fam, g) in enumerate(ctx.families):
            if g is None or not ctx.first_of[rank]:
                continue
            i = g.start + int(e[g.start:g.stop].argmin())
            best = e.item(i)
            if best == INF:
                continue
            if best <= target and (qt is None or depth.item(i) <= qt):
                return i
            if not evaluated[rank].rejected_reason:
                evaluated[rank] = _exceeded(evaluated[rank])
        return ctx.first(e)
    if prio == "cost":
        pick = cheapest_within_rows(ctx, target, qt)
        return ctx.first(e) if pick is None else pick
    near = e <= target * BALANCED_FRACTION
    if qt is not None:
        near &= ctx.table.depth <= qt
    rows = near.nonzero()[0]
    if len(rows):
        return weighted_rows(ctx, rows, 1.0, 1.0, target)
    pick = cheapest_within_rows(ctx, target, qt)
    return ctx.first(e) if pick is None else pick
