"""Per-replica leases on a shared plan budget (zmlcore.access.shares): replicas simulated against one
in-memory entry written the way SharedLimiter writes the KV entry (settle, write, commit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zmlcore.access.shares import LEASE_S, MAX_LEASE, SHARE, SLOT_TTL_S, Book, lease_size, slot_target
from zmlcore.messages.keys import LimitState, PlanLimits
from zmlcore.access.plans import PLANS, WINDOW_S, Verdict, admit

T0 = 1_000_020.0  # a window start


@dataclass
class Entry:
    state: LimitState = field(default_factory=LimitState)
    writes: int = 0


@dataclass
class Replica:
    name: str
    entry: Entry
    book: Book | None = None

    def admit(self, limits: PlanLimits, now: float, lease_id: str, lease_s: float = 30.0) -> Verdict:
        if self.book is None:
            self.book = Book(limits)
        v = self.book.spend(limits, now=now, lease_id=lease_id, lease_s=lease_s)
        if v is not None:
            return v
        st = self.book.settle(self.entry.state, limits, now=now, holder=self.name, take=True, lease_id=lease_id,
                              lease_s=lease_s)
        self._write(st)
        self.book.commit(st, limits, now=now, lease_id=lease_id, lease_s=lease_s)
        assert st.verdict is not None
        return st.verdict

    def flush(self, now: float, closing: bool = False) -> None:
        assert self.book is not None
        st = self.book.settle(self.entry.state, self.book.limits, now=now, holder=self.name, take=False,
                              closing=closing)
        self._write(st)
        self.book.commit(st, self.book.limits, now=now)

    def done(self, lease_id: str, now: float, tokens: int = 0) -> None:
        assert self.book is not None
        if self.book.done(lease_id, tokens=tokens, now=now):
            self.flush(now)

    def sweep(self, now: float) -> None:
        if self.book is not None and self.book.due(now):
            self.flush(now)

    def _write(self, st) -> None:  # type: ignore[no-untyped-def]
        if st.state is not None:
            self.entry.state, self.entry.writes = st.state, self.entry.writes + 1


def _pair(entry: Entry | None = None) -> tuple[Replica, Replica]:
    entry = entry or Entry()
    return Replica("gw-a", entry), Replica("gw-b", entry)


def test_lease_size_follows_the_rate_and_shrinks_near_the_limit() -> None:
    big = PlanLimits(requests_per_minute=1_000_000)
    assert lease_size(0.0, big, LimitState(), now=T0) == 1
    assert lease_size(300.0, big, LimitState(), now=T0) == round(300 * LEASE_S)
    assert lease_size(1e9, big, LimitState(), now=T0) == MAX_LEASE
    team = PLANS["team"]  # 600/minute: at most 1/SHARE of what is left
    assert lease_size(1e9, team, LimitState(), now=T0) == 600 // SHARE
    near = LimitState(window=int(T0 // WINDOW_S), requests=590)
    assert lease_size(1e9, team, near, now=T0) == 1  # 10 left: one at a time, exact
    tokens = PlanLimits(tokens_per_minute=1000)
    assert lease_size(50.0, tokens, LimitState(), now=T0) == 50
    assert lease_size(50.0, tokens, LimitState(window=int(T0 // WINDOW_S), tokens=950), now=T0) == 1


def test_slot_target() -> None:
    assert slot_target(0, 50) == 0
    assert slot_target(1, 2) == 1 and slot_target(2, 2) == 2  # small plans: exactly what runs
    assert slot_target(4, 100_000) == 8  # twice the need when slots are plenty
    assert slot_target(10, 50) == 10 + 40 // SHARE
    assert slot_target(3, 1) == 3  # never fewer than run already


def test_a_small_plan_is_exact_across_two_replicas() -> None:
    a, b = _pair()
    limits = PlanLimits(requests_per_minute=10)
    verdicts = [(a, b)[i % 2].admit(limits, T0 + i * 0.01, f"r{i}") for i in range(24)]
    assert [v.ok for v in verdicts] == [True] * 10 + [False] * 14
    assert [v.requests_remaining for v in verdicts[:10]] == list(range(9, -1, -1))
    refused = verdicts[-1]
    assert refused.reason == "requests" and refused.retry_after_s > 0 and refused.requests_remaining == 0


def test_a_hot_key_writes_about_once_per_lease_not_per_request() -> None:
    a, _ = _pair()
    limits = PlanLimits(requests_per_minute=10_000_000, concurrent=100_000)
    n, rate = 3000, 500.0  # 6 s at 500 req/s
    for i in range(n):
        now = T0 + i / rate
        assert a.admit(limits, now, f"r{i}").ok
        a.done(f"r{i}", now + 0.005)
        a.sweep(now)
    # The lease ramps up within a few writes, then about one write per LEASE_S.
    assert a.entry.writes <= 6 / LEASE_S + 25, a.entry.writes
    a.flush(T0 + n / rate + 2 * LEASE_S, closing=True)
    # What is counted is exactly what was spent once the unspent lease is given back.
    assert a.entry.state.requests == n and a.entry.state.holds == {}


def test_two_hot_replicas_never_exceed_the_plan_and_lose_little() -> None:
    a, b = _pair()
    limits = PLANS["team"]  # 600/minute, 50 concurrent
    admitted = {"gw-a": 0, "gw-b": 0}
    t = T0
    i = 0
    while t < T0 + WINDOW_S - 1:  # both hammer one key at ~50 req/s each, all of one window
        for r in (a, b):
            v = r.admit(limits, t, f"{r.name}-{i}")
            if v.ok:
                admitted[r.name] += 1
                r.done(f"{r.name}-{i}", t + 0.01)
            r.sweep(t)
        t += 0.02
        i += 1
    total = sum(admitted.values())
    assert total <= 600, admitted
    # Stranded leases are at most 1/SHARE of what was left, and shrink to 1 near the limit.
    assert total >= 600 - 2 * SHARE, admitted
    assert min(admitted.values()) > 200, admitted  # neither replica starves the other


def test_unspent_lease_is_given_back_when_it_ends() -> None:
    a, b = _pair()
    limits = PlanLimits(requests_per_minute=6000)
    for i in range(100):  # a burst: the lease grows
        a.admit(limits, T0 + i * 0.001, f"r{i}")
    assert a.book is not None and a.book.requests > 0
    leased = a.entry.state.requests
    assert leased > 100  # counted ahead of spending
    a.sweep(T0 + 0.5)
    assert a.entry.state.requests == leased  # the lease still runs
    a.sweep(T0 + LEASE_S + 0.2)
    assert a.entry.state.requests == 100 and a.book.requests == 0
    # What the other replica's headers say comes from the shared entry.
    v = b.admit(limits, T0 + LEASE_S + 0.3, "x")
    assert v.ok and v.requests_remaining == 6000 - 101


def test_a_lease_left_over_a_window_edge_goes_back_to_the_previous_window() -> None:
    a, _ = _pair()
    limits = PlanLimits(requests_per_minute=6000)
    edge = T0 + WINDOW_S
    for i in range(50):
        a.admit(limits, edge - 0.5 + i * 0.001, f"r{i}")
    assert a.book is not None and a.book.until <= edge  # a lease never crosses the window
    a.sweep(edge + 0.1)
    s = a.entry.state
    assert s.window == int(edge // WINDOW_S) and s.prev_requests == 50 and s.requests == 0


def test_remaining_counts_the_unspent_lease_of_this_replica() -> None:
    a, _ = _pair()
    limits = PlanLimits(requests_per_minute=6000)
    remaining = [a.admit(limits, T0 + i * 0.001, f"r{i}").requests_remaining for i in range(200)]
    assert remaining == list(range(5999, 5799, -1))


def test_concurrency_is_exact_for_a_small_plan_across_replicas() -> None:
    a, b = _pair()
    limits = PlanLimits(concurrent=2)
    assert a.admit(limits, T0, "a1").ok
    assert b.admit(limits, T0, "b1").ok
    v = a.admit(limits, T0, "a2")
    assert not v.ok and v.reason == "concurrent"
    assert not b.admit(limits, T0, "b2").ok
    a.done("a1", T0 + 1)  # near the limit the freed slot goes back at once
    assert a.entry.state.holds["gw-a"].slots == 0 if "gw-a" in a.entry.state.holds else True
    assert b.admit(limits, T0 + 1, "b3").ok
    assert not a.admit(limits, T0 + 1, "a3").ok


def test_plenty_of_slots_are_held_without_a_write_per_request() -> None:
    a, _ = _pair()
    limits = PlanLimits(concurrent=1000)
    for i in range(8):  # 8 in flight, then a steady 8
        assert a.admit(limits, T0, f"r{i}").ok
    writes = a.entry.writes
    for i in range(8, 400):
        a.done(f"r{i - 8}", T0 + i * 0.001)
        assert a.admit(limits, T0 + i * 0.001, f"r{i}").ok
    assert a.entry.writes - writes <= 10  # the request lease ramping up; no write for slots
    assert a.book is not None and a.book.busy == 8


def test_a_dead_replicas_slots_expire() -> None:
    a, b = _pair()
    limits = PlanLimits(concurrent=3)
    for i in range(3):
        assert a.admit(limits, T0, f"a{i}").ok
    # a dies (no renewals, no done): b is refused until the hold ends.
    assert not b.admit(limits, T0 + 1, "b0").ok
    assert b.admit(limits, T0 + SLOT_TTL_S + 0.1, "b1").ok


def test_holds_are_renewed_while_requests_run() -> None:
    a, b = _pair()
    limits = PlanLimits(concurrent=1)
    assert a.admit(limits, T0, "long", lease_s=300).ok
    for k in range(1, 40):  # 20 s of sweeps every half second
        a.sweep(T0 + k * 0.5)
    assert not b.admit(limits, T0 + 20, "b").ok
    a.done("long", T0 + 20.1)
    assert b.admit(limits, T0 + 20.2, "b2").ok


def test_a_request_whose_end_never_comes_stops_counting_after_its_lease() -> None:
    a, _ = _pair()
    limits = PlanLimits(concurrent=1)
    assert a.admit(limits, T0, "lost", lease_s=5).ok
    assert not a.admit(limits, T0 + 1, "x").ok
    assert a.admit(limits, T0 + 6, "y").ok


def test_tokens_are_written_later_and_at_once_near_the_limit() -> None:
    a, b = _pair()
    limits = PlanLimits(tokens_per_minute=1000)
    assert a.admit(limits, T0, "r1").ok
    a.done("r1", T0 + 0.1, tokens=10)
    assert a.entry.state.tokens == 0  # far from the limit: with the next write
    a.sweep(T0 + 0.2)
    assert a.entry.state.tokens == 0
    a.sweep(T0 + LEASE_S + 0.2)
    assert a.entry.state.tokens == 10
    assert a.admit(limits, T0 + 2, "r2").ok
    a.done("r2", T0 + 2.1, tokens=985)  # near the limit: written at once
    assert a.entry.state.tokens == 995
    assert b.admit(limits, T0 + 2.2, "b1").ok  # 995 < 1000
    b.done("b1", T0 + 2.3, tokens=10)
    v = a.admit(limits, T0 + 2.4, "r3")
    assert not v.ok and v.reason == "tokens" and v.tokens_remaining == 0


def test_closing_gives_everything_back() -> None:
    a, b = _pair()
    limits = PlanLimits(requests_per_minute=6000, concurrent=10)
    for i in range(100):
        a.admit(limits, T0 + i * 0.001, f"r{i}")
        a.done(f"r{i}", T0 + i * 0.001, tokens=1)
    a.flush(T0 + 0.2, closing=True)
    s = a.entry.state
    assert s.requests == 100 and s.tokens == 100 and "gw-a" not in s.holds
    assert a.book is not None and a.book.idle()


def test_a_plan_change_takes_effect_at_once() -> None:
    a, _ = _pair()
    team, tiny = PLANS["team"], PlanLimits(requests_per_minute=1)
    for i in range(50):
        assert a.admit(team, T0 + i * 0.001, f"r{i}").ok
    v = a.admit(tiny, T0 + 0.1, "x")  # the lease of the old plan is not spent under the new one
    assert not v.ok and v.requests_limit == 1


def test_leases_agree_with_the_one_entry_per_request_counter() -> None:
    """Against the exact counter (plans.admit: one shared write per request), a single replica
    with leases admits the same requests over two minutes of uneven traffic."""
    limits = PlanLimits(requests_per_minute=120)
    a, _ = _pair()
    exact = LimitState()
    t, i = T0 + 5, 0
    while t < T0 + 2 * WINDOW_S:
        new, v_exact = admit(exact, limits, now=t, lease_id=f"r{i}", lease_s=30)
        exact = new or exact
        v = a.admit(limits, t, f"r{i}")
        a.done(f"r{i}", t)
        a.sweep(t)
        assert v.ok == v_exact.ok, (i, t - T0)
        t += 0.05 if (i // 100) % 2 else 0.7  # bursts and lulls
        i += 1
