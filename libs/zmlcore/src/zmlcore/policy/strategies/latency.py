"""``latency``: the node with the lowest estimated TTFT (STE, see policy/estimate.py).

Near-ties: estimates within a window of the lowest count as equal, and the tie goes to the
node with the slowest prefill. A short prompt costs a slow node little more than a fast one,
while a long prompt needs a fast node whose prefill queue is empty: keeping the fast nodes
free for it is what lowers the tail (the greedy rule, tie 0, takes the fast node every time).
A node's window is ``TIE_S`` while its slots are free and shrinks to nothing as its queue
depth reaches ``TIE_SLOTS`` of its sequence slots: a slow node filled with short prompts
decodes them slowly and holds its slots, and a burst then queues behind them.
"""

from __future__ import annotations

import numpy as np

from zmlcore.policy.context import Cand, Ctx, VCtx, fastest

#: Estimates within this many seconds of the lowest are a tie (chosen on tuning seeds of
#: benches/routing_sim.py, reported on others: docs/benchmarks.md "Routing quality (simulation)").
TIE_S = 0.03
#: ... only while the lowest estimate is under this: a queueing fleet has no spare fast node.
TIE_BELOW_S = 0.1
#: ... and a node's window is ``TIE_S * (1 - slot_use / TIE_SLOTS)``: none at this share of
#: its sequence slots taken (queue depth / max concurrency).
TIE_SLOTS = 1.0


def pick(cands: list[Cand], tie_s: float, below_s: float, slots: float = TIE_SLOTS) -> Cand | None:
    best = fastest(cands)
    if best is None or tie_s <= 0.0 or best.est > below_s:
        return best
    e0 = best.est
    limit = e0 + tie_s  # the widest window: most candidates stop here, before slot_use
    for c in cands:
        if (
            c.est <= limit and (c.pf, c.est, c.rank) < (best.pf, best.est, best.rank)
            and c.est <= e0 + tie_s * (1.0 - c.slot_use / slots)
        ):
            best = c
    return best


def select(ctx: Ctx) -> Cand | None:
    return pick(ctx.candidates(), TIE_S, TIE_BELOW_S)


def pick_rows(ctx: VCtx, tie_s: float, below_s: float, slots: float = TIE_SLOTS) -> int | None:
    """:func:`pick` over every row: the fastest, or of it and the rows within their window of
    it, the lowest (prefill speed, estimate, rank, row)."""
    e = ctx.estimates()
    i = ctx.first(e)
    if i is None or tie_s <= 0.0:
        return i
    e0 = e.item(i)
    if e0 > below_s:
        return i
    near = np.flatnonzero(e <= e0 + tie_s)  # the widest window; the fastest is among them
    if len(near) == 1:
        return i
    t = ctx.table
    inside = e[near] <= e0 + tie_s * (1.0 - t.depth[near] / t.maxc[near] / slots)
    rows = near[inside | (near == i)]  # the fastest stays in, whatever its slots
    pf = t.pf[rows]
    return ctx.first_of_rows(rows[pf == pf.min()], e)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    return pick_rows(ctx, TIE_S, TIE_BELOW_S)
