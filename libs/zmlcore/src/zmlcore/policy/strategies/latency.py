"""``latency``: the node with the lowest estimated TTFT (STE, see policy/estimate.py), where a
node's estimate counts only the prompt tokens it does not hold in its prefix cache.

Sticky until saturated: a node that holds more of the prompt (warm) wins over the node with the
lowest estimate (the reference) while its estimate is worse by less than the reference's time to
prefill what it lacks and the warm node holds: ``est_w <= est_ref + (cached_w - cached_ref) /
pf_ref``. Sending the request to the reference would cost the fleet that recomputation (its
requester pays it once in the estimate, the fleet pays it again in capacity, and the conversation
then lives on two nodes); once the warm node's queue makes up for it, the prefix is worth less
than the wait and the request spills. The budget comes from the nodes' own speeds: ~0.1 s for
1,000 tokens on an H100, 0.33 s on an Inferentia2. Among warm candidates, the lowest
``est - cached / pf_ref`` wins.

Near-ties (no node holds more than the reference): estimates within a window of the lowest
count as equal, and the tie goes to the node with the slowest prefill. A short prompt costs a
slow node little more than a fast one, while a long prompt needs a fast node whose prefill
queue is empty: keeping the fast nodes free for it is what lowers the tail (the greedy rule,
tie 0, takes the fast node every time). A node's window is ``TIE_S`` while its slots are free
and shrinks to nothing as its queue depth reaches ``TIE_SLOTS`` of its sequence slots: a slow
node filled with short prompts decodes them slowly and holds its slots, and a burst then queues
behind them. Nodes holding less of the prompt than the reference are not tie candidates.
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


def sticky(cands: list[Cand], ref: Cand) -> Cand:
    """The warm candidate that beats ``ref`` within its budget, or ``ref``."""
    best, best_s = ref, ref.est - ref.cached / ref.pf
    inv = 1.0 / ref.pf
    for c in cands:
        if c.cached > ref.cached:
            s = c.est - c.cached * inv
            if s < best_s or (s == best_s and (c.est, c.rank) < (best.est, best.rank)):
                best, best_s = c, s
    return best


def pick(cands: list[Cand], tie_s: float, below_s: float, slots: float = TIE_SLOTS) -> Cand | None:
    best = fastest(cands)
    if best is None:
        return None
    warm = sticky(cands, best)
    if warm is not best:
        return warm
    if tie_s <= 0.0 or best.est > below_s:
        return best
    e0, c0 = best.est, best.cached
    limit = e0 + tie_s  # the widest window: most candidates stop here, before slot_use
    for c in cands:
        if (
            c.est <= limit and c.cached >= c0 and (c.pf, c.est, c.rank) < (best.pf, best.est, best.rank)
            and c.est <= e0 + tie_s * (1.0 - c.slot_use / slots)
        ):
            best = c
    return best


def select(ctx: Ctx) -> Cand | None:
    return pick(ctx.candidates(), TIE_S, TIE_BELOW_S)


def pick_rows(ctx: VCtx, tie_s: float, below_s: float, slots: float = TIE_SLOTS) -> int | None:
    """:func:`pick` over every row: the fastest, or a warmer row within its budget, or of the
    fastest and the rows within their window of it, the lowest (prefill speed, estimate, rank,
    row)."""
    e = ctx.estimates()
    i = ctx.first(e)
    if i is None:
        return None
    t = ctx.table
    c = ctx.cached
    e0 = e.item(i)
    c0 = 0.0
    if c is not None:
        c0 = c.item(i)
        warm = c > c0
        if warm.any():
            inv = 1.0 / t.pf.item(i)
            s = np.where(warm, e - c * inv, np.inf)
            sw, s0 = s.min().item(), e0 - c0 * inv
            if sw <= s0:
                w = ctx.first_of_rows(np.flatnonzero(s == sw), e)
                if sw < s0 or (e.item(w), ctx.ranks[t.fam[w]]) < (e0, ctx.ranks[t.fam[i]]):
                    return w
    if tie_s <= 0.0 or e0 > below_s:
        return i
    near = np.flatnonzero(e <= e0 + tie_s)  # the widest window; the fastest is among them
    if len(near) == 1:
        return i
    inside = e[near] <= e0 + tie_s * (1.0 - t.depth[near] / t.maxc[near] / slots)
    if c is not None:
        inside &= c[near] >= c0
    rows = near[inside | (near == i)]  # the fastest stays in, whatever its slots
    pf = t.pf[rows]
    return ctx.first_of_rows(rows[pf == pf.min()], e)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    return pick_rows(ctx, TIE_S, TIE_BELOW_S)
