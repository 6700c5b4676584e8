"""The saturation queue's order. Pure: time is passed in.

    i = pick(waiting, service, now, age_s=30.0, level=book.fair_level(now))   # next when a slot frees
    for j in displaced(waiting, service, now, age_s=30.0, limit=256, level=level): ...answer SHED...

What a router replica does with its window of the queue, and the flow simulator with each
replica's (benches/flow_sim.py), through the same two functions:

    r = rank_window(held, book, now, age_s=30.0, max_queued=256)   # order, to shed, best (band, over)
    i = first_with_room(r.order, has_room)                          # the entry a freed slot goes to

1. Higher bands first (a ``sheddable`` entry ages up to ``standard``, a ``batch`` line rises when
   its completion window closes).
2. Within a band, the entries of tenants that are not over their share in arrival order; a
   tenant is over its share when its recent service per unit of weight is above the fair
   ``level`` *and* it has a backlog of its own waiting (at least ``BACKLOG`` entries).
3. Then the over-share tenants' entries by start-time fair queueing in tokens: an entry starts
   at its tenant's service plus the cost of that tenant's entries queued before it (each entry
   adds ``cost / weight``); lowest start first. Backlogged tenants thus share what the others
   leave in proportion to their weights, counted in tokens, and a flood's backlog always goes
   after everyone else's next request.

Why the two classes: strict least-service order among tenants at their share (they wander
+/-15-20% around it: heavy-tailed prompts over a 30 s half-life) pushed whichever was a little
ahead, mid-burst, behind all the others: p99 TTFT x3 at 90% load in benches/flow_sim.py; arrival
order among tenants that take no more than their share costs nothing in fairness. Why the
backlog: a flood held back to spare capacity hovers near its share (it takes what is left), but
always has work waiting; the service alone could not tell it from a steady tenant.

Nothing dispatched is ever cut: only waiting entries are reordered or displaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from zmlcore.flowctl.bands import NAMES, SHEDDABLE, STANDARD
from zmlcore.flowctl.shares import ShareBook


@dataclass(slots=True)
class Waiting:
    """One queued request, as the order sees it."""

    band: int
    tenant: str
    weight: float
    #: unix s it entered the queue (first time: a request handed back keeps it)
    enqueued_at: float
    #: arrival order among entries (the queue stream's sequence): FIFO within a tenant
    seq: int
    #: unix s from which it is urgent (a batch line near the end of its completion window):
    #: it then ranks as ``standard``
    urgent_at: float = float("inf")
    #: its estimated cost in weighted tokens (ShareBook.cost of its prompt and a mean output)
    cost: float = 0.0


#: tenant, weight -> service per unit of weight (ShareBook.service with ``now`` bound)
Service = Callable[[str, float], float]
#: A tenant with at least this many entries of its own waiting is asking for more than the
#: fleet gives it now (zmlcore.flowctl.gate uses the same bound).
BACKLOG = 8


def effective_band(w: Waiting, now: float, age_s: float) -> int:
    """A ``sheddable`` entry rises to ``standard`` once it has waited ``age_s``: low-band work
    waits behind higher bands, but not for ever. A ``batch`` entry waits for spare capacity
    until it is urgent (``urgent_at``: its completion window closing), then ranks as
    ``standard``, so that it finishes within its window without taking interactive slots before."""
    if w.band <= STANDARD:
        return w.band
    if now >= w.urgent_at:
        return STANDARD
    if w.band == SHEDDABLE and age_s > 0 and now - w.enqueued_at >= age_s:
        return STANDARD
    return w.band


def _backlog(waiting: Sequence[Waiting], elsewhere: Mapping[tuple[str, int], int] | None
             ) -> dict[tuple[str, float, int], int]:
    """(tenant, weight, band) -> its entries waiting in that band: fair shares are within a band,
    so a tenant's backlog in a lower band does not make its higher-band work over its share
    (held back to spare capacity, and behind the band's other tenants)."""
    backlog: dict[tuple[str, float, int], int] = {}
    for w in waiting:
        k = (w.tenant, w.weight, w.band)
        b = backlog.get(k)
        backlog[k] = (elsewhere.get((w.tenant, w.band), 0) if elsewhere else 0) + 1 if b is None else b + 1
    return backlog


def keys(waiting: Sequence[Waiting], service: Service, now: float, age_s: float,
         level: float = 0.0, elsewhere: Mapping[tuple[str, int], int] | None = None) -> list[tuple[int, int, float, int]]:
    """Each entry's sort key: (effective band, over its share?, virtual start, arrival). A
    tenant's service is looked up once per call. ``elsewhere``: (tenant, band) -> its entries
    waiting beyond ``waiting`` (the other replicas' windows of the queue), part of its backlog: a
    replica holding 5 of a flood's 36 must not rank them as an under-share tenant's (it then
    announced a better band than it held, and the replica holding the other 31 left every
    freed slot to it; the node ran idle while the flood waited)."""
    backlog = _backlog(waiting, elsewhere)
    start: dict[tuple[str, float, int], float] = {}
    out: list[tuple[int, int, float, int]] = [(0, 0, 0.0, 0)] * len(waiting)
    for i in sorted(range(len(waiting)), key=lambda i: waiting[i].seq):
        w = waiting[i]
        k = (w.tenant, w.weight, w.band)
        band = effective_band(w, now, age_s)
        if backlog[k] < BACKLOG:
            out[i] = (band, 0, 0.0, w.seq)
            continue
        s = start.get(k)
        if s is None:
            s = service(w.tenant, w.weight)
            if s <= level:  # backlogged but not over its share: in arrival order with the rest
                start[k] = -1.0
                out[i] = (band, 0, 0.0, w.seq)
                continue
        elif s < 0:
            out[i] = (band, 0, 0.0, w.seq)
            continue
        out[i] = (band, 1, s, w.seq)
        start[k] = s + w.cost / (w.weight if w.weight > 0 else 1.0)
    return out


def ranked(waiting: Sequence[Waiting], service: Service, now: float, age_s: float, level: float = 0.0,
           elsewhere: Mapping[tuple[str, int], int] | None = None) -> list[int]:
    """Indexes of ``waiting``, best first."""
    ks = keys(waiting, service, now, age_s, level, elsewhere)
    return sorted(range(len(waiting)), key=ks.__getitem__)


def pick(waiting: Sequence[Waiting], service: Service, now: float, age_s: float, level: float = 0.0) -> int | None:
    """Index of the entry to dispatch next (None: nothing waits).

    >>> ws = [Waiting(band=2, tenant="a", weight=1, enqueued_at=0, seq=1),
    ...       Waiting(band=1, tenant="b", weight=1, enqueued_at=5, seq=2)]
    >>> pick(ws, lambda t, w: 0.0, now=6.0, age_s=30.0)
    1
    """
    if not waiting:
        return None
    ks = keys(waiting, service, now, age_s, level)
    return min(range(len(waiting)), key=ks.__getitem__)


def displaced(waiting: Sequence[Waiting], service: Service, now: float, age_s: float, limit: int,
              level: float = 0.0, elsewhere: Mapping[tuple[str, int], int] | None = None) -> list[int]:
    """Indexes of the entries to shed so that ``limit`` remain, first to go first: from the
    lowest band, a backlogged tenant's (the flood's) before anyone else's, each in reverse rank
    order. A queue over its size sheds a flood's tail, not whoever happened to arrive last."""
    excess = len(waiting) - limit
    if excess <= 0:
        return []
    ks = keys(waiting, service, now, age_s, level, elsewhere)
    backlog = _backlog(waiting, elsewhere)

    def worst(i: int) -> tuple[int, bool, tuple[int, int, float, int]]:
        w = waiting[i]
        return ks[i][0], backlog[(w.tenant, w.weight, w.band)] >= BACKLOG, ks[i]

    return sorted(range(len(waiting)), key=worst, reverse=True)[:excess]


def best_rank(waiting: Sequence[Waiting], service: Service, now: float, age_s: float,
              level: float = 0.0, elsewhere: Mapping[tuple[str, int], int] | None = None) -> tuple[int, int] | None:
    """(band, over-share class) of the best entry: what a holder announces to its peers, so that
    a replica holding only lower-ranked entries leaves a freed slot to the one holding a better one."""
    if not waiting:
        return None
    b = min(keys(waiting, service, now, age_s, level, elsewhere))
    return b[0], b[1]


#: Entries a freed slot is offered to, best first, before it stays free (a head whose preferred
#: node is full waits; one behind it may fit elsewhere).
TRIES = 8


@dataclass(frozen=True, slots=True)
class Ranking:
    """A replica's window of the queue, ranked."""

    #: indexes of the window's entries, best first
    order: list[int]
    #: indexes to answer SHED (past ``max_queued``), first to go first
    shed: list[int]
    #: (band, over-share) of the best entry: what the replica announces to its peers
    top: tuple[int, int]


def rank_window(waiting: Sequence[Waiting], book: ShareBook, now: float, *, age_s: float,
                max_queued: int) -> Ranking:
    """Rank what one replica holds of the queue (``waiting``), as the router does on each pass
    and the flow simulator for each replica's window. Records the window's backlog per tenant
    and band in ``book`` (reported to the peers with the share counters), and counts the peers'
    (their last reports) in each tenant's backlog: a tenant's backlog is every replica's window's.

    >>> b = ShareBook("r1")
    >>> ws = [Waiting(band=1, tenant="a", weight=1, enqueued_at=0, seq=1),
    ...       Waiting(band=0, tenant="b", weight=1, enqueued_at=1, seq=2)]
    >>> r = rank_window(ws, b, now=2.0, age_s=30.0, max_queued=256)
    >>> r.order, r.shed, r.top, b.own_waiting
    ([1, 0], [], (0, 0), {'a': 1, 'b': 1})
    """
    backlog: dict[str, int] = {}
    bands: dict[str, int] = {}
    by_band: dict[str, dict[str, int]] = {}
    for w in waiting:
        backlog[w.tenant] = backlog.get(w.tenant, 0) + 1
        name = NAMES[w.band]
        bands[name] = bands.get(name, 0) + 1
        ts = by_band.setdefault(name, {})
        ts[w.tenant] = ts.get(w.tenant, 0) + 1
    book.set_waiting(backlog, bands, by_band)

    def service(tenant: str, weight: float) -> float:
        return book.service(tenant, weight, now)

    level = book.fair_level(now)
    elsewhere = book.waiting_elsewhere()
    shed = displaced(waiting, service, now, age_s, max_queued, level, elsewhere)
    ks = keys(waiting, service, now, age_s, level, elsewhere)
    order = sorted(range(len(waiting)), key=ks.__getitem__)
    top = (ks[order[0]][0], ks[order[0]][1]) if order else (STANDARD, 0)
    return Ranking(order, shed, top)


def first_with_room(order: Sequence[int], has_room: Callable[[int, int], bool], tries: int = TRIES) -> int | None:
    """The entry a freed slot goes to: the first of ``order`` (best first, at most ``tries``
    asked) that ``has_room(index, ahead)`` admits (``ahead``: entries before it in ``order``,
    for zmlcore.flowctl.gate.admit_flow: with a backlog ahead, any free slot will do), None if
    none. Room moves with time (a peer's unseen sends age out), so once a worse entry has room,
    the better ones skipped are asked again first: a worse one never takes a slot a better one
    could have (a pass found a ``critical`` entry without room a millisecond before a
    ``standard`` one with room: tests/chaos/test_chaos_flow.py).

    >>> room = {2}
    >>> first_with_room([0, 1, 2], lambda i, ahead: i in room), first_with_room([0, 1], lambda i, ahead: i in room)
    (2, None)
    """
    skipped: list[tuple[int, int]] = []
    for pos, i in enumerate(order[:tries]):
        if has_room(i, pos):
            return next((j for j, before in skipped if has_room(j, before)), i)
        skipped.append((i, pos))
    return None
