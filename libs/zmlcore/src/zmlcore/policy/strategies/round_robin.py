"""``round_robin``: every routable node in turn, ignoring load (the cursor lives in
RoutingState). Unstable on a heterogeneous fleet above the slowest node's share of capacity."""

from __future__ import annotations

from zmlcore.policy.context import Cand, Ctx, VCtx
from zmlcore.policy.estimate import INF


def select(ctx: Ctx) -> Cand | None:
    flat = ctx.table.flat
    n = len(flat)
    if not n:
        return None
    fams = {f.lower(): r for r, (f, _c) in enumerate(ctx.families)}
    start = ctx.state.rr_cursor
    for k in range(n):
        cls, i = flat[(start + k) % n]
        rank = fams.get(cls.family.lower())
        if rank is None or cls.keys[i] == INF or not ctx.check(cls, i):
            continue
        ctx.state.rr_cursor = start + k + 1
        return Cand(cls, i, ctx.est(cls, i), rank)
    return None


def select_rows(ctx: VCtx) -> int | None:
    pick = select(ctx)
    return None if pick is None else pick.i
