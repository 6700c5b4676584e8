"""The saturation queue's order: higher bands first, the tenant with the least recent service
per unit of weight next (``zmlcore.flowctl.shares``), arrival last; long waits age a low band up,
and past the queue's size the lowest-ranked entries are displaced (SHED). Pure: time is passed in.

    i = pick(waiting, service, now, age_s=30.0)       # the entry to dispatch when a slot frees
    for j in displaced(waiting, service, now, age_s=30.0, limit=256): ...answer SHED...

Nothing dispatched is ever cut: only waiting entries are reordered or displaced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zmlcore.flowctl.bands import STANDARD


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


#: tenant, weight -> service per unit of weight (ShareBook.service with ``now`` bound)
Service = Callable[[str, float], float]


def effective_band(w: Waiting, now: float, age_s: float) -> int:
    """A ``sheddable`` (or lower) entry rises one band for every ``age_s`` it has waited, never
    above ``standard``: low-band work waits behind higher bands, but not for ever."""
    if w.band <= STANDARD or age_s <= 0:
        return w.band
    steps = int((now - w.enqueued_at) // age_s)
    return max(STANDARD, w.band - steps)


def rank_key(w: Waiting, service: Service, now: float, age_s: float) -> tuple[int, float, int]:
    return (effective_band(w, now, age_s), service(w.tenant, w.weight), w.seq)


def ranked(waiting: Sequence[Waiting], service: Service, now: float, age_s: float) -> list[int]:
    """Indexes of ``waiting``, best first. A tenant's service is looked up once per call."""
    memo: dict[tuple[str, float], float] = {}

    def svc(tenant: str, weight: float) -> float:
        k = (tenant, weight)
        v = memo.get(k)
        if v is None:
            v = memo[k] = service(tenant, weight)
        return v

    return sorted(range(len(waiting)), key=lambda i: rank_key(waiting[i], svc, now, age_s))


def pick(waiting: Sequence[Waiting], service: Service, now: float, age_s: float) -> int | None:
    """Index of the entry to dispatch next (None: nothing waits).

    >>> ws = [Waiting(band=2, tenant="a", weight=1, enqueued_at=0, seq=1),
    ...       Waiting(band=1, tenant="b", weight=1, enqueued_at=5, seq=2)]
    >>> pick(ws, lambda t, w: 0.0, now=6.0, age_s=30.0)
    1
    """
    if not waiting:
        return None
    memo: dict[tuple[str, float], float] = {}
    best, best_key = 0, None
    for i, w in enumerate(waiting):
        k = (w.tenant, w.weight)
        s = memo.get(k)
        if s is None:
            s = memo[k] = service(w.tenant, w.weight)
        key = (effective_band(w, now, age_s), s, w.seq)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def displaced(waiting: Sequence[Waiting], service: Service, now: float, age_s: float, limit: int) -> list[int]:
    """Indexes of the entries past ``limit`` in rank order (lowest-ranked first to go): a queue
    over its size sheds its least important work, not its newest."""
    if len(waiting) <= limit:
        return []
    return ranked(waiting, service, now, age_s)[limit:]


def best_rank(waiting: Sequence[Waiting], service: Service, now: float, age_s: float) -> tuple[int, float] | None:
    """(band, service) of the best entry: what a holder announces to its peers, so that a replica
    holding only lower-ranked entries leaves a freed slot to the one holding a better entry."""
    i = pick(waiting, service, now, age_s)
    if i is None:
        return None
    w = waiting[i]
    return effective_band(w, now, age_s), service(w.tenant, w.weight)
