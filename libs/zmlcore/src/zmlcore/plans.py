"""Plans and the pure arithmetic of their limits (no I/O: time is passed in).

Presets as the API reference gives them (Maker 60 requests/minute and 5 concurrent, Team 600 and
50); ``custom`` takes any numbers plus tokens per minute.

    state, verdict = admit(LimitState(), PLANS["maker"], now=time.time(), lease_id="r1", lease_s=60)
    if not verdict.ok: ...429 with verdict.retry_after_s...
    state = release(state, now=time.time(), lease_id="r1", tokens=120)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from zmlcore.messages.keys import LimitState, PlanLimits

WINDOW_S = 60
PLANS: dict[str, PlanLimits] = {
    "maker": PlanLimits(requests_per_minute=60, concurrent=5),
    "team": PlanLimits(requests_per_minute=600, concurrent=50),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    #: "requests", "tokens" or "concurrent" when refused.
    reason: str = ""
    retry_after_s: float = 0.0
    requests_limit: int | None = None
    requests_remaining: int = 0
    requests_reset_s: float = 0.0
    tokens_limit: int | None = None
    tokens_remaining: int = 0
    tokens_reset_s: float = 0.0


def _roll(state: LimitState, now: float) -> LimitState:
    """The state with its windows moved to the one ``now`` falls in, and expired leases gone."""
    window = int(now // WINDOW_S)
    leases = {k: v for k, v in state.leases.items() if v > now}
    if window == state.window:
        return msgspec.structs.replace(state, leases=leases)
    if window == state.window + 1:
        return LimitState(window=window, prev_requests=state.requests, prev_tokens=state.tokens, leases=leases)
    return LimitState(window=window, leases=leases)


def _used(prev: int, cur: int, frac: float) -> float:
    return prev * (1.0 - frac) + cur


def _wait(prev: int, cur: int, frac: float, limit: int, need: float) -> float:
    """Seconds until the sliding estimate leaves room for ``need`` more (current window counts
    stay, the previous one slides out; then the next window starts with this one as previous)."""
    room = limit - need
    if cur <= room and prev > 0:
        return max(0.0, (1.0 - (room - cur) / prev) - frac) * WINDOW_S
    if cur <= room:
        return 0.0
    later = 1.0 - room / cur if cur > 0 else 0.0
    return ((1.0 - frac) + max(0.0, later)) * WINDOW_S


def _reset(prev: int, cur: int, frac: float) -> float:
    if cur:
        return (2.0 - frac) * WINDOW_S
    return (1.0 - frac) * WINDOW_S if prev else 0.0


def admit(state: LimitState, limits: PlanLimits, *, now: float, lease_id: str,
          lease_s: float) -> tuple[LimitState | None, Verdict]:
    """Count one request against ``limits``. Returns the new state (None when refused: nothing
    to write) and the verdict with what the x-ratelimit-* headers say."""
    s = _roll(state, now)
    frac = (now % WINDOW_S) / WINDOW_S
    rpm, tpm, conc = limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent
    used_r = _used(s.prev_requests, s.requests, frac)
    used_t = _used(s.prev_tokens, s.tokens, frac)
    base = dict(requests_limit=rpm, tokens_limit=tpm,
                tokens_remaining=max(0, math.floor(tpm - used_t)) if tpm else 0,
                tokens_reset_s=_reset(s.prev_tokens, s.tokens, frac))
    if rpm is not None and used_r + 1 > rpm + 1e-9:  # float slack: 2/3 of 60 is 40, not 40.000001
        wait = _wait(s.prev_requests, s.requests, frac, rpm, 1)
        return None, Verdict(False, "requests", max(wait, 0.001), requests_remaining=0,
                             requests_reset_s=_reset(s.prev_requests, s.requests, frac), **base)
    if tpm is not None and used_t >= tpm:
        wait = _wait(s.prev_tokens, s.tokens, frac, tpm, 1)
        return None, Verdict(False, "tokens", max(wait, 0.001),
                             requests_remaining=max(0, math.floor(rpm - used_r)) if rpm else 0,
                             requests_reset_s=_reset(s.prev_requests, s.requests, frac), **base)
    if conc is not None and len(s.leases) >= conc:
        return None, Verdict(False, "concurrent", 1.0,
                             requests_remaining=max(0, math.floor(rpm - used_r)) if rpm else 0,
                             requests_reset_s=_reset(s.prev_requests, s.requests, frac), **base)
    leases = s.leases if conc is None else {**s.leases, lease_id: now + lease_s}
    new = msgspec.structs.replace(s, requests=s.requests + 1, leases=leases)
    return new, Verdict(True, requests_remaining=max(0, math.floor(rpm - used_r - 1)) if rpm else 0,
                        requests_reset_s=_reset(new.prev_requests, new.requests, frac), **base)


def release(state: LimitState, *, now: float, lease_id: str, tokens: int) -> LimitState:
    """The request ended: free its lease and count the tokens it used."""
    s = _roll(state, now)
    leases = {k: v for k, v in s.leases.items() if k != lease_id}
    return msgspec.structs.replace(s, tokens=s.tokens + max(0, tokens), leases=leases)


def plan_limits(plan: str, *, requests_per_minute: int | None = None, concurrent: int | None = None,
                tokens_per_minute: int | None = None) -> PlanLimits:
    """A preset, with any number given overriding it (``custom`` starts from no limits)."""
    if plan != "custom" and plan not in PLANS:
        from zmlcore.errors import BadRequestError

        raise BadRequestError(f"unknown plan {plan!r}: maker, team or custom")
    base = PLANS.get(plan, PlanLimits())
    return PlanLimits(
        requests_per_minute=requests_per_minute if requests_per_minute is not None else base.requests_per_minute,
        concurrent=concurrent if concurrent is not None else base.concurrent,
        tokens_per_minute=tokens_per_minute if tokens_per_minute is not None else base.tokens_per_minute,
    )
