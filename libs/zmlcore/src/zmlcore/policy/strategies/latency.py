"""``latency``: the node with the lowest estimated TTFT (STE, see policy/estimate.py).

Near-ties: estimates within ``TIE_S`` of the lowest count as equal, and the tie goes to the
node with the slowest prefill. A short prompt costs a slow node little more than a fast one,
while a long prompt needs a fast node whose prefill queue is empty: keeping the fast nodes
free for it is what lowers the tail (the greedy rule, tie 0, takes the fast node every time).
"""

from __future__ import annotations

import numpy as np

from zmlcore.policy.context import Cand, Ctx, VCtx, fastest

#: Estimates within this many seconds of the lowest are a tie (chosen on tuning seeds of
#: benches/routing_sim.py, reported on others: docs/benchmarks.md "Routing quality (simulation)").
TIE_S = 0.03
#: ... only while the lowest estimate is under this: a queueing fleet has no spare fast node.
TIE_BELOW_S = 0.1


def pick(cands: list[Cand], tie_s: float, below_s: float) -> Cand | None:
    best = fastest(cands)
    if best is None or tie_s <= 0.0 or best.est > below_s:
        return best
    limit = best.est + tie_s
    for c in cands:
        if c.est <= limit and (c.pf, c.est, c.rank) < (best.pf, best.est, best.rank):
            best = c
    return best


def select(ctx: Ctx) -> Cand | None:
    return pick(ctx.candidates(), TIE_S, TIE_BELOW_S)


def pick_rows(ctx: VCtx, tie_s: float, below_s: float) -> int | None:
    """:func:`pick` over every row: the fastest, or of the rows within ``tie_s`` of it, the
    lowest (prefill speed, estimate, rank, row)."""
    e = ctx.estimates()
    i = ctx.first(e)
    if i is None or tie_s <= 0.0:
        return i
    e0 = e.item(i)
    if e0 > below_s:
        return i
    pf = np.where(e <= e0 + tie_s, ctx.table.pf, np.inf)
    return ctx.first_of_rows(np.flatnonzero(pf == pf.min()), e)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    return pick_rows(ctx, TIE_S, TIE_BELOW_S)
