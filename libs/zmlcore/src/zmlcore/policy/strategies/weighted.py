"""``weighted``: minimise ``latency_weight * est/target + cost_weight * cost/cheapest`` over the
nodes whose queue is within ``queue_threshold``; the fastest node when every queue is above it.

Both terms are normalised: the estimated TTFT by the latency target (default 500 ms), the cost
per unit of capacity by the cheapest candidate's, so the weights compare like with like.
"""

from __future__ import annotations

import numpy as np

from zmlcore.policy.context import Cand, Ctx, VCtx, fastest


def weighted_pick(cands: list[Cand], lw: float, cw: float, target_s: float) -> Cand | None:
    if not cands:
        return None
    cheapest = min(c.cost_cap for c in cands) or 1.0
    best = None
    best_s = 0.0
    for c in cands:
        s = lw * c.est / target_s + cw * c.cost_cap / cheapest
        if best is None or s < best_s or (s == best_s and c.rank < best.rank):
            best, best_s = c, s
    return best


def select(ctx: Ctx) -> Cand | None:
    cands = ctx.candidates()
    cfg = ctx.policy.config
    qt = cfg.queue_threshold
    ok = cands if qt is None else [c for c in cands if c.depth <= qt]
    if not ok:
        return fastest(cands)
    return weighted_pick(ok, cfg.latency_weight or 0.0, cfg.cost_weight or 0.0, ctx.target_s)


def weighted_rows(ctx: VCtx, rows: np.ndarray, lw: float, cw: float, target_s: float) -> int | None:
    """:func:`weighted_pick` over ``rows`` (ascending, with a finite estimate). The score is
    computed as ``weighted_pick`` computes it, term by term; a weight of 1 multiplies nothing
    and a weight of 0 adds 0 (both exact). Only those rows are scored."""
    if not len(rows):
        return None
    e = ctx.estimates()[rows]
    cost = ctx.table.cost_cap[rows]
    cheapest = cost.item(cost.argmin())
    if cheapest == np.inf:
        return None
    cheapest = float(cheapest) or 1.0
    s: np.ndarray | None = None
    if lw:
        s = (e if lw == 1.0 else lw * e) / target_s
    if cw:
        c = (cost if cw == 1.0 else cw * cost) / cheapest
        s = c if s is None else s + c
    return ctx.first_in(rows, np.zeros(len(rows)) if s is None else s)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    e = ctx.estimates()
    cfg = ctx.policy.config
    qt = cfg.queue_threshold
    m = e != np.inf
    if qt is not None:
        m &= ctx.table.depth <= qt
    rows = m.nonzero()[0]
    if not len(rows):
        return ctx.first(e)
    return weighted_rows(ctx, rows, cfg.latency_weight or 0.0, cfg.cost_weight or 0.0, ctx.target_s)
