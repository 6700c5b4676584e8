"""``cost``: the cheapest node per unit of capacity whose estimated TTFT stays within the cost
threshold and whose queue is under ``queue_threshold``; the fastest node when none does.

Cost is $/h divided by the node's saturation throughput (req/s), i.e. what one unit of work
costs there. The default threshold is 40% of the latency target (200 ms for the 500 ms default),
chosen on tuning seeds of benches/routing_sim.py: against ``latency`` it saves ~5% at 80% load
for < 0.5 point of within-target share (half the target, the reference's ``cost_aware_250``:
6-7% for 0.5-0.6 points), while a threshold equal to the target loses 6-9 points.
"""

from __future__ import annotations

import numpy as np

from zmlcore.policy.context import Cand, Ctx, VCtx, fastest

#: Fraction of the latency target the cheap node's estimate must stay within.
COST_THRESHOLD_FRACTION = 0.4


def cheapest_within(cands: list[Cand], threshold_s: float, queue_threshold: float | None) -> Cand | None:
    best = None
    for c in cands:
        if c.est > threshold_s or (queue_threshold is not None and c.depth > queue_threshold):
            continue
        if best is None or (c.cost_cap, c.est, c.rank) < (best.cost_cap, best.est, best.rank):
            best = c
    return best


def select(ctx: Ctx) -> Cand | None:
    cands = ctx.candidates()
    pick = cheapest_within(cands, ctx.target_s * COST_THRESHOLD_FRACTION, ctx.policy.config.queue_threshold)
    return pick or fastest(cands)


def cheapest_within_rows(ctx: VCtx, threshold_s: float, queue_threshold: float | None) -> int | None:
    """:func:`cheapest_within` over every row: lowest (cost, estimate, rank, row)."""
    e = ctx.estimates()
    t = ctx.table
    m = e <= threshold_s
    if queue_threshold is not None:
        m &= t.depth <= queue_threshold
    rows = m.nonzero()[0]  # ascending: the first cheapest of them is the lowest row
    if not len(rows):
        return None
    c = t.cost_cap[rows]
    cmin = c.item(c.argmin())
    if cmin == np.inf:
        return None
    return ctx.first_of_rows(rows[c == cmin], e)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    pick = cheapest_within_rows(ctx, ctx.target_s * COST_THRESHOLD_FRACTION, ctx.policy.config.queue_threshold)
    return ctx.first(ctx.estimates()) if pick is None else pick
