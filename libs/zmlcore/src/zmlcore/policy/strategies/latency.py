"""``latency``: the node with the lowest estimated TTFT (STE, see policy/estimate.py)."""

from __future__ import annotations

from zmlcore.policy.context import Cand, Ctx, fastest


def select(ctx: Ctx) -> Cand | None:
    return fastest(ctx.candidates())
