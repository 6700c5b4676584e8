"""``weighted``: minimise ``latency_weight * est/target + cost_weight * cost/cheapest`` over the
nodes whose queue is within ``queue_threshold``; the fastest node when every queue is above it.

Both terms are normalised: the estimated TTFT by the latency target (default 500 ms), the cost
per unit of capacity by the cheapest candidate's, so the weights compare like with like.
"""

from __future__ import annotations

from zmlcore.policy.context import Cand, Ctx, fastest


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
