"""``latency``: the node with the lowest estimated TTFT (STE, see policy/estimate.py), where a
node's estimate counts only the prompt tokens it does not hold in its prefix cache.

Sticky until saturated. Call the node with the lowest estimate the reference. A node that holds
more of the prompt (warm) wins over it while

    est_w - est_ref <= (cached_w - cached_ref) / pf_ref / (1 - rho_ref)

the reference's time to prefill what it lacks and the warm node holds, divided by one minus the
reference's load. Sending the request to the reference costs the fleet that recomputation
twice: its requester pays it once (it is in ``est_ref``), and the reference's other work pays it
again, since work added to a node at utilisation ``rho`` delays everything queued behind it by
about ``W / (1 - rho)`` (the M/G/1 busy-period argument). ``rho_ref`` is the reference's share of
sequence slots taken (capped at :data:`RHO_MAX`). ``rho / (1 - rho)`` stands for the requests the
recomputation delays, and it counts no more of them than the reference holds
(``1 + min(rho / (1 - rho), depth_ref)``): a node of 4 slots with 4 requests on it has 4 to delay,
not the 9 of a 0.9 utilisation, and a budget of 10x the recomputation kept conversations in the
queue of a saturated fast llama-server, 5-7 deep on 4 slots, while the other node held 3-4
(benches/real_fleet.py). A node with a free slot, and any node of 9 slots or more once saturated,
is unchanged by the bound. The budget comes from the nodes' own speed
and load, not a constant: ~0.1 s per 1,000 tokens on an idle H100, 0.33 s on an idle
Inferentia2, several times that on a busy one. Once the warm node's queue outweighs it, the
prefix is worth less than the wait and the request spills ("until saturated"). Among warm
candidates, the lowest ``est - cached / pf_ref * load_factor(ref)`` wins. On tuning seeds of
benches/routing_sim.py this beat fixed budgets of 0, 0.5, 1, 2 and 4 times the recomputation
at 80% load (agent p90 TTFT 4-6x lower than 1x, hot-prefix 1.5-3x lower than 2x) and was within
the noise of them at 50% (docs/routing.md, "Sticky until saturated").

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
from zmlcore.policy.estimate import INF

#: The budget's multiple of the reference's recomputation (the derivation gives 1; other values
#: only for the simulator's comparisons), and whether it is divided by ``1 - rho_ref``.
STICKY = 1.0
STICKY_LOAD = True
#: ``rho_ref`` at most this (a full node's budget is 10x its recomputation, not infinite).
RHO_MAX = 0.9
#: Estimates within this many seconds of the lowest are a tie (chosen on tuning seeds of
#: benches/routing_sim.py, reported on others: docs/benchmarks.md "Routing quality (simulation)").
TIE_S = 0.03
#: ... only while the lowest estimate is under this: a queueing fleet has no spare fast node.
TIE_BELOW_S = 0.1
#: ... and a node's window is ``TIE_S * (1 - slot_use / TIE_SLOTS)``: none at this share of
#: its sequence slots taken (queue depth / max concurrency).
TIE_SLOTS = 1.0


def load_factor(depth: float, maxc: float) -> float:
    """The budget's multiple of the reference's recomputation: ``1 / (1 - rho)``, the
    recomputation and the work it delays, counting no more delayed requests than the ``depth``
    the reference holds.

    >>> load_factor(0, 4), load_factor(2, 4), round(load_factor(4, 4), 6), load_factor(6, 4)
    (1.0, 2.0, 5.0, 7.0)
    >>> round(load_factor(256, 256), 6), round(load_factor(100, 256), 3)  # a GPU's slots: as before
    (10.0, 1.641)
    """
    rho = min(RHO_MAX, depth / maxc)
    f = 1.0 / (1.0 - rho)
    return f if f <= 1.0 + depth else 1.0 + depth


def sticky(cands: list[Cand], ref: Cand) -> Cand:
    """The warm candidate that beats ``ref`` within its budget, or ``ref``."""
    inv = STICKY / ref.pf
    if STICKY_LOAD:
        t = ref.cls.table
        inv *= load_factor(float(t.depth[ref.i]), float(t.maxc[ref.i]))
    best, best_s = ref, ref.est - ref.cached * inv
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
        # only the rows warmer than the fastest are scored: usually a handful of the fleet
        listed = ctx.warm_rows
        warm: np.ndarray | None = None
        if listed and listed[0] >= 0:  # the warm rows, listed by cached_rows: no pass over c
            wl: list[int] | None = sorted(j for j in listed if c.item(j) > c0)
        else:
            warm = (c > c0).nonzero()[0]
            wl = warm.tolist() if len(warm) <= 8 else None
        nw = len(wl) if wl is not None else len(warm) if warm is not None else 0
        if nw:
            inv = STICKY / t.pf.item(i)
            if STICKY_LOAD:
                inv *= load_factor(t.depth.item(i), t.maxc.item(i))
            s0 = e0 - c0 * inv
            if wl is not None and nw <= 8:  # a few: plain floats (same operations, same results)
                sw = INF
                tied: list[int] = []
                for j in wl:
                    x = e.item(j) - c.item(j) * inv
                    if x < sw:
                        sw, tied = x, [j]
                    elif x == sw:
                        tied.append(j)
                w = tied[0] if len(tied) == 1 or sw > s0 else ctx.first_of_rows(np.array(tied), e)
            else:
                if warm is None:
                    warm = np.array(wl, dtype=np.intp)
                s = e[warm] - c[warm] * inv
                sw = s.item(s.argmin())
                w = ctx.first_of_rows(warm[s == sw], e) if sw <= s0 else -1
            if sw <= s0 and (sw < s0 or (e.item(w), ctx.ranks[t.fam[w]]) < (e0, ctx.ranks[t.fam[i]])):
                return w
    if tie_s <= 0.0 or e0 > below_s:
        return i
    near = (e <= e0 + tie_s).nonzero()[0]  # the widest window; the fastest is among them
    if len(near) == 1:
        return i
    inside = e[near] <= e0 + tie_s * (1.0 - t.depth[near] / t.maxc[near] / slots)
    if c is not None:
        inside &= c[near] >= c0
    rows = near[inside | (near == i)]  # the fastest stays in, whatever its slots
    pf = t.pf[rows]
    return ctx.first_of_rows(rows[pf == pf.item(pf.argmin())], e)


def select_rows(ctx: VCtx) -> int | None:
    ctx.evaluate()
    return pick_rows(ctx, TIE_S, TIE_BELOW_S)
