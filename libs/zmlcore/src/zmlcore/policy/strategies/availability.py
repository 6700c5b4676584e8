"""``availability``: the node with the most remaining capacity, i.e. the one that would drain
its queue plus this request soonest: smallest ``(outstanding + 1) / capacity`` (capacity in
req/s at full batch). Spreads load in proportion to capacity; ignores prompt length and price."""

from __future__ import annotations

from zmlcore.policy.context import Cand, Ctx, VCtx


def select(ctx: Ctx) -> Cand | None:
    best: Cand | None = None
    best_d = 0.0
    for rank, (_fam, cls) in enumerate(ctx.families):
        if cls is None:
            continue
        i = ctx.best_drain(cls)
        if i is None:
            continue
        d = cls.drains[i]
        if best is None or d < best_d:
            best = Cand(cls, i, ctx.est(cls, i), rank)
            best_d = d
    return best


def select_rows(ctx: VCtx) -> int | None:
    """:func:`select` over every row: lowest (drain key, rank, row)."""
    return ctx.first(ctx.drains())
