"""Per-replica leases on a shared plan budget: the pure half of :class:`~zmlcore.access.limiter.SharedLimiter`
(no I/O; time is passed in).

One KV compare-and-set per request made a hot key slow (two round trips before dispatch, two
after). Instead each limiter replica keeps a :class:`Book` per limited identity and

- takes a **lease** of several requests at once. They are counted in the shared window when
  taken, so every replica together never counts past the plan; they are spent here without a
  round trip, and the unused ones are given back when the lease ends (``LEASE_S``, or the
  minute window's end, whichever is first) or at shutdown;
- holds concurrency **slots** (a :class:`~zmlcore.messages.keys.Hold` in the shared entry,
  renewed while held): a request starts here while a held slot is free. A replica that dies
  frees its slots when the hold's ``until`` passes (``SLOT_TTL_S``);
- counts **tokens** here and adds them to the shared entry with its next write (at most about
  ``LEASE_S`` later; at once when the plan's tokens are nearly used).

Sizes. A lease is the replica's recent rate x ``LEASE_S`` (so about one write per second per
replica on a hot key), but never more than 1/``SHARE`` of what the plan has left this minute
nor ``MAX_LEASE``; slots are twice what is in flight, but the extra never more than 1/``SHARE``
of the free ones. Near the limit both shrink to exactly one request / what is in flight: a
small plan (Maker's 60 requests and 5 concurrent) behaves exactly like one shared counter.

Slack (what the limits and headers may be off by; docs/security.md):

- requests/minute: never more than the plan (a lease is counted before it is spent). A replica
  may refuse while another still holds unspent leased requests: at most 1/SHARE of what was
  left when each lease was taken, given back within LEASE_S. A replica that dies leaves its
  unspent lease counted until the window slides past it (under-admission, never over).
- concurrency: never more than the plan while holds are renewed; idle held slots (at most
  1/SHARE of the free ones per replica) are given back at once when slots run short.
- tokens: counted after the reply as before, and another replica's tokens are seen up to about
  LEASE_S late (at once near the limit); a lease taken before the tokens ran out may be spent
  for up to LEASE_S after.
- ``x-ratelimit-remaining-requests``: the shared remainder as of this replica's last write
  plus its own unspent lease; what other replicas admitted since (their last LEASE_S) is not seen.

    book = Book(limits)
    verdict = book.spend(limits, now=now, lease_id="r1", lease_s=60)   # None: a round trip
    if verdict is None:
        st = book.settle(state_read_from_kv, limits, now=now, holder="gw-1", take=True, lease_id="r1", lease_s=60)
        ...write st.state with compare-and-set, then book.commit(st)...
    if book.done("r1", tokens=120, now=now): ...write soon (settle with take=False)...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zmlcore.messages.keys import Hold, LimitState, PlanLimits
from zmlcore.access.plans import WINDOW_S, Verdict, granted, in_use, refusal_of, roll, used

#: Life of a request lease: on a hot key, about one KV write per replica per LEASE_S.
LEASE_S = 1.0
#: Life of a concurrency hold; renewed at half of it while slots are held.
SLOT_TTL_S = 10.0
#: A lease takes at most 1/SHARE of what is left, extra slots at most 1/SHARE of the free ones.
SHARE = 8
#: Largest lease (requests), whatever the rate.
MAX_LEASE = 1000


def lease_size(rate: float, limits: PlanLimits, s: LimitState, *, now: float) -> int:
    """Requests to lease for a replica admitting ``rate`` requests/s, against rolled state
    ``s`` (which does not count the lease yet): at least 1 when one more fits at all."""
    n = min(MAX_LEASE, max(1, math.ceil(rate * LEASE_S - 1e-9)))
    frac = (now % WINDOW_S) / WINDOW_S
    if limits.requests_per_minute is not None:
        left = limits.requests_per_minute - used(s.prev_requests, s.requests, frac)
        n = min(n, math.floor(left / SHARE + 1e-9))
    if limits.tokens_per_minute is not None:
        left_t = limits.tokens_per_minute - used(s.prev_tokens, s.tokens, frac)
        if left_t < limits.tokens_per_minute / SHARE:  # tokens nearly gone: no spending ahead
            n = 1
    return max(1, n)


def slot_target(need: int, free: int) -> int:
    """Slots to hold for ``need`` in flight when ``free`` are not held by other replicas:
    twice the need, the extra at most 1/SHARE of what would stay free; never fewer than the
    need (those requests run already, or are being admitted within ``free``)."""
    if need <= 0:
        return 0
    return need + min(need, max(0, free - need) // SHARE)


@dataclass(frozen=True, slots=True)
class Settlement:
    """The outcome of :meth:`Book.settle`: the state to write (None: nothing changed), the
    verdict when admitting, and what the book becomes once the write succeeded."""

    state: LimitState | None
    seen: LimitState
    verdict: Verdict | None
    lease: int  # requests leased and still unspent after this admission
    lease_until: float
    slots: int
    tokens: int  # pending tokens this write adds to the shared entry
    free: int  # slots not held by other replicas (concurrency plans)
    rate: float


@dataclass(slots=True)
class Book:
    """One limited identity in one replica: its lease, held slots, in-flight requests and the
    tokens it has not written yet. Mutated only by the event loop that owns it."""

    limits: PlanLimits
    window: int = -1
    requests: int = 0  # leased, unspent
    until: float = 0.0
    slots: int = 0
    slots_until: float = 0.0
    tokens: int = 0
    busy: int = 0
    #: lease id -> (requests in flight under it, when they stop counting even without done()).
    inflight: dict[str, tuple[int, float]] = field(default_factory=dict)
    rate: float = 0.0
    rate_at: float = 0.0
    seen: LimitState | None = None
    free: int = 0
    written_at: float = 0.0
    #: A settle is being written: spend() waits for it (its lease is about to be replaced).
    writing: bool = False

    def _rate(self, now: float) -> float:
        """Admissions/s, decayed with time constant LEASE_S (one more counted now)."""
        return self.rate * math.exp(-max(0.0, now - self.rate_at) / LEASE_S) + 1.0 / LEASE_S

    def _start(self, lease_id: str, lease_s: float, now: float) -> None:
        count, _ = self.inflight.get(lease_id, (0, 0.0))
        self.inflight[lease_id] = (count + 1, now + lease_s)
        self.busy += 1

    def prune(self, now: float) -> None:
        """Forget in-flight requests past their lease whose done() never came."""
        gone = [k for k, (_, end) in self.inflight.items() if end <= now]
        for k in gone:
            self.busy -= self.inflight.pop(k)[0]

    def _tokens_used(self, now: float) -> float:
        assert self.seen is not None
        frac = (now % WINDOW_S) / WINDOW_S
        return used(self.seen.prev_tokens, self.seen.tokens, frac) + self.tokens

    def spend(self, limits: PlanLimits, *, now: float, lease_id: str, lease_s: float) -> Verdict | None:
        """Admit one request from the lease and a held slot; None when that needs the shared
        entry (no lease, lease ended, plan changed, no free slot, tokens nearly gone)."""
        if self.writing or self.requests <= 0 or now >= self.until or self.seen is None or limits != self.limits:
            return None
        if limits.concurrent is not None and (self.busy >= self.slots or now >= self.slots_until):
            return None
        tpm = limits.tokens_per_minute
        if tpm is not None and tpm - self._tokens_used(now) < tpm / SHARE:  # near the limit: ask the entry
            return None
        self.requests -= 1
        self.rate, self.rate_at = self._rate(now), now
        self._start(lease_id, lease_s, now)
        return granted(self.seen, limits, now=now, unspent=self.requests, tokens=self.tokens)

    def done(self, lease_id: str, *, tokens: int, now: float) -> bool:
        """A request ended. True when the shared entry should hear of it soon (idle slots or
        tokens that matter because the plan is near its limit)."""
        count, end = self.inflight.pop(lease_id, (0, 0.0))
        if count:
            self.busy -= 1
            if count > 1:
                self.inflight[lease_id] = (count - 1, end)
        self.tokens += max(0, tokens)
        return self.urgent(now)

    def urgent(self, now: float) -> bool:
        if self.writing:
            return False
        if self.limits.concurrent is not None and self.slots > self.busy:
            spare = self.free - self.slots  # free slots nobody holds, as of the last write
            if self.slots - self.busy > max(0, spare) // SHARE:
                return True
        tpm = self.limits.tokens_per_minute
        if tpm is not None and self.tokens > 0 and self.seen is not None:
            if tpm - self._tokens_used(now) < tpm / SHARE:
                return True
        return False

    def due(self, now: float) -> bool:
        """Should the periodic sweep write now (lease ended with requests left, tokens waiting,
        a hold to renew or give back)?"""
        self.prune(now)
        if self.writing:
            return False
        if self.requests > 0 and now >= self.until:
            return True
        if self.tokens > 0 and now - self.written_at >= LEASE_S:
            return True
        if self.slots > 0 and (self.slots_until - now < SLOT_TTL_S / 2 or (self.busy == 0 and now >= self.until)):
            return True
        return self.urgent(now)

    def idle(self) -> bool:
        """Nothing held, pending or in flight: the book can be forgotten."""
        return not (self.writing or self.requests or self.slots or self.tokens or self.busy or self.inflight)

    def settle(self, state: LimitState, limits: PlanLimits, *, now: float, holder: str, take: bool,
               lease_id: str = "", lease_s: float = 0.0, closing: bool = False) -> Settlement:
        """Merge this book into the shared ``state`` just read: give back the unspent lease,
        add pending tokens, and (``take``) admit one request with a fresh lease; set this
        holder's slots to what is in flight (plus headroom; none when ``closing``)."""
        self.prune(now)
        s = roll(state, now)
        before = (s.requests, s.prev_requests, s.tokens, s.holds.get(holder))
        keep = not (take or closing or now >= self.until)  # a sweep keeps a lease still running
        if self.requests > 0 and not keep:  # back to the window it was counted in
            if s.window == self.window:
                s.requests = max(0, s.requests - self.requests)
            elif s.window == self.window + 1:
                s.prev_requests = max(0, s.prev_requests - self.requests)
        s.tokens += self.tokens
        conc = limits.concurrent
        free = 0 if conc is None else max(0, conc - in_use(s, but=holder))
        verdict, rate, need = None, self.rate, self.busy
        lease, until = (self.requests, self.until) if keep else (0, 0.0)
        if take:
            refused = refusal_of(s, limits, now=now, busy=in_use(s, but=holder) + self.busy)
            if refused is not None:
                verdict = refused
            else:
                rate = self._rate(now)
                n = lease_size(rate, limits, s, now=now)
                s.requests += n
                need, lease = self.busy + 1, n - 1
                until = min(now + LEASE_S, (s.window + 1) * WINDOW_S)
                verdict = granted(s, limits, now=now, unspent=lease)
        slots = 0 if conc is None or closing else slot_target(need, free)
        holds = {k: h for k, h in s.holds.items() if k != holder}
        if slots:
            holds[holder] = Hold(slots=slots, until=now + SLOT_TTL_S)
        s.holds = holds
        changed = before != (s.requests, s.prev_requests, s.tokens, s.holds.get(holder))
        return Settlement(state=s if changed else None, seen=s, verdict=verdict, lease=lease, lease_until=until,
                          slots=slots, tokens=self.tokens, free=free, rate=rate)

    def commit(self, st: Settlement, limits: PlanLimits, *, now: float, lease_id: str = "",
               lease_s: float = 0.0) -> None:
        """The settlement's state was written (or needed no write): take it on."""
        self.limits = limits
        self.seen = st.seen
        self.window = st.seen.window
        self.requests, self.until = st.lease, st.lease_until
        self.slots = st.slots
        self.slots_until = now + SLOT_TTL_S if st.slots else 0.0
        self.tokens -= st.tokens  # done() may have added more meanwhile
        self.free = st.free
        self.written_at = now
        if st.verdict is not None and st.verdict.ok:
            self.rate, self.rate_at = st.rate, now
            self._start(lease_id, lease_s, now)

