"""Plans and the pure arithmetic of their limits (no I/O: time is passed in).

Presets as the API reference gives them (Maker 60 requests/minute and 5 concurrent, Team 600 and
50); ``custom`` takes any numbers plus tokens per minute.

    state, verdict = admit(LimitState(), PLANS["maker"], now=time.time(), lease_id="r1", lease_s=60)
    if not verdict.ok: ...429 with verdict.retry_after_s...
    state = release(state, now=time.time(), lease_id="r1", tokens=120)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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


def verdict_headers(v: Verdict) -> list[tuple[str, str]]:
    """The ``x-ratelimit-*`` header pairs of a verdict (HTTP headers at the gateway, NATS
    headers of the router's RATE_LIMITED reply to a client identity)."""
    out: list[tuple[str, str]] = []
    if v.requests_limit is not None:
        out += [("x-ratelimit-limit-requests", str(v.requests_limit)),
                ("x-ratelimit-remaining-requests", str(v.requests_remaining)),
                ("x-ratelimit-reset-requests", f"{v.requests_reset_s:.3f}s")]
    if v.tokens_limit is not None:
        out += [("x-ratelimit-limit-tokens", str(v.tokens_limit)),
                ("x-ratelimit-remaining-tokens", str(v.tokens_remaining)),
                ("x-ratelimit-reset-tokens", f"{v.tokens_reset_s:.3f}s")]
    return out


def refusal(plan: str, limits: PlanLimits, v: Verdict) -> str:
    """The message of a RATE_LIMITED answer."""
    what = {"requests": f"{limits.requests_per_minute} requests/minute",
            "tokens": f"{limits.tokens_per_minute} tokens/minute",
            "concurrent": f"{limits.concurrent} concurrent requests",
            "contended": "the limiter's retries"}.get(v.reason, v.reason)
    return f"plan {plan!r}: over {what}; retry in {v.retry_after_s:.1f} s"


def limited(limits: PlanLimits) -> bool:
    """Does the plan limit anything at all?"""
    return not (limits.requests_per_minute is None and limits.concurrent is None and limits.tokens_per_minute is None)


def roll(state: LimitState, now: float) -> LimitState:
    """The state with its windows moved to the one ``now`` falls in, and expired leases gone."""
    window = int(now // WINDOW_S)
    leases = {k: v for k, v in state.leases.items() if v > now}
    holds = {k: h for k, h in state.holds.items() if h.until > now}
    if window == state.window:
        return msgspec.structs.replace(state, leases=leases, holds=holds)
    if window == state.window + 1:
        return LimitState(window=window, prev_requests=state.requests, prev_tokens=state.tokens, leases=leases,
                          holds=holds)
    return LimitState(window=window, leases=leases, holds=holds)


def used(prev: int, cur: int, frac: float) -> float:
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


def in_use(s: LimitState, *, but: str = "") -> int:
    """Concurrency slots taken in ``s`` (rolled: expired ones gone), except holder ``but``'s."""
    return len(s.leases) + sum(h.slots for k, h in s.holds.items() if k != but)


def refusal_of(s: LimitState, limits: PlanLimits, *, now: float, busy: int) -> Verdict | None:
    """Why one more request is refused against rolled state ``s`` with ``busy`` slots taken
    (None: it fits), with what the x-ratelimit-* headers say."""
    frac = (now % WINDOW_S) / WINDOW_S
    rpm, tpm, conc = limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent
    used_r = used(s.prev_requests, s.requests, frac)
    used_t = used(s.prev_tokens, s.tokens, frac)
    left = max(0, math.floor(rpm - used_r + 1e-9)) if rpm else 0
    base = Verdict(False, requests_limit=rpm, requests_remaining=left,
                   requests_reset_s=_reset(s.prev_requests, s.requests, frac), tokens_limit=tpm,
                   tokens_remaining=max(0, math.floor(tpm - used_t)) if tpm else 0,
                   tokens_reset_s=_reset(s.prev_tokens, s.tokens, frac))
    if rpm is not None and used_r + 1 > rpm + 1e-9:  # float slack: 2/3 of 60 is 40, not 40.000001
        wait = _wait(s.prev_requests, s.requests, frac, rpm, 1)
        return replace(base, reason="requests", retry_after_s=max(wait, 0.001), requests_remaining=0)
    if tpm is not None and used_t >= tpm:
        wait = _wait(s.prev_tokens, s.tokens, frac, tpm, 1)
        return replace(base, reason="tokens", retry_after_s=max(wait, 0.001))
    if conc is not None and busy >= conc:
        return replace(base, reason="concurrent", retry_after_s=1.0)
    return None


def granted(s: LimitState, limits: PlanLimits, *, now: float, unspent: int = 0, tokens: int = 0) -> Verdict:
    """The verdict of an admitted request once ``s`` counts it (and ``unspent`` more requests
    leased but not spent yet, which are still the caller's to use; ``tokens`` used but not yet
    in ``s``)."""
    frac = (now % WINDOW_S) / WINDOW_S
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    used_r = used(s.prev_requests, s.requests, frac)
    used_t = used(s.prev_tokens, s.tokens, frac) + tokens
    return Verdict(True, requests_limit=rpm, tokens_limit=tpm,
                   requests_remaining=max(0, math.floor(rpm - used_r + 1e-9) + unspent) if rpm else 0,
                   requests_reset_s=_reset(s.prev_requests, s.requests, frac),
                   tokens_remaining=max(0, math.floor(tpm - used_t)) if tpm else 0,
                   tokens_reset_s=_reset(s.prev_tokens, s.tokens, frac))


def admit(state: LimitState, limits: PlanLimits, *, now: float, lease_id: str,
          lease_s: float) -> tuple[LimitState | None, Verdict]:
    """Count one request against ``limits`` (one shared entry per request, no replica leases).
    Returns the new state (None when refused: nothing to write) and the verdict with what the
    x-ratelimit-* headers say."""
    s = roll(state, now)
    refused = refusal_of(s, limits, now=now, busy=in_use(s))
    if refused is not None:
        return None, refused
    leases = s.leases if limits.concurrent is None else {**s.leases, lease_id: now + lease_s}
    new = msgspec.structs.replace(s, requests=s.requests + 1, leases=leases)
    return new, granted(new, limits, now=now)


def release(state: LimitState, *, now: float, lease_id: str, tokens: int) -> LimitState:
    """The request ended: free its lease and count the tokens it used."""
    s = roll(state, now)
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
