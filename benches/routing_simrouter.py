"""The router replicas' in-flight accounting in the routing simulator (helper of
benches/routing_sim.py), as the live router keeps it:

* each replica counts what it dispatched at once (``outstanding`` +1 and ``pending`` +1);
* ``pending`` ends at the first token for a streamed request, and for a non-streamed one (the
  router sees no first token) after ``expiry`` x its estimated TTFT
  (``zmlcore.policy.estimate.NONSTREAM_PENDING_FOR``), or at completion if sooner;
  ``expiry`` 0 keeps it pending until completion;
* replicas that share counters see each other's deltas after a NATS lag drawn uniformly from
  ``lag`` (seconds), or at once when ``lag`` is None; without sharing they never do (then only
  the 5 s poll tells them).

Events go through ``push(t, kind, a, b)`` (the simulator's heap): ``DELTA`` (replica a receives
delta b) and ``EXPIRE`` (request a's pending ends).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from zmlcore.policy import NodeView

DELTA, EXPIRE = 3, 4
Push = Callable[[float, int, int, int], None]


class SimRouters:
    def __init__(self, views: list[list[NodeView]], n: int, *, share: bool = True,
                 lag: tuple[float, float] | None = None, local: bool = True, count_pending: bool = True,
                 expiry: float = 0.0, seed: int = 0) -> None:
        self.views = views  # views[replica][node]
        self.share = share
        self.lag = lag
        self.local = local
        self.count_pending = count_pending
        self.expiry = expiry
        self.rnd = random.Random(seed)
        self.rep_of = [0] * n
        self.node_of = [0] * n
        self.pend_open = [False] * n
        self._deltas: dict[int, tuple[int, int, int]] = {}
        self._next = 0

    def _count(self, ri: int, idx: int, d_out: int, d_pend: int, now: float, push: Push) -> None:
        if not self.local:
            return
        for rj in range(len(self.views)):
            if rj != ri and not self.share:
                continue
            if rj == ri or self.lag is None:
                self.apply(rj, idx, d_out, d_pend)
            else:
                self._next += 1
                self._deltas[self._next] = (idx, d_out, d_pend)
                push(now + self.rnd.uniform(*self.lag), DELTA, rj, self._next)

    def apply(self, rj: int, idx: int, d_out: int, d_pend: int) -> None:
        v = self.views[rj][idx]
        if d_out:
            v.outstanding += d_out
        if d_pend:
            v.pending += d_pend

    def deliver(self, rj: int, key: int) -> None:
        """A peer's delta reaches replica ``rj`` (a DELTA event)."""
        self.apply(rj, *self._deltas.pop(key))

    def dispatch(self, r: int, ri: int, idx: int, streamed: bool, est_ttft: float, now: float, push: Push) -> None:
        self.rep_of[r] = ri
        self.node_of[r] = idx
        self.pend_open[r] = self.count_pending
        self._count(ri, idx, 1, 1 if self.count_pending else 0, now, push)
        if self.count_pending and self.expiry and not streamed:
            push(now + self.expiry * est_ttft, EXPIRE, r, 0)

    def first_token(self, r: int, streamed: bool, now: float, push: Push) -> None:
        """Prefill of r ended: only a stream shows it to the router."""
        if streamed and self.pend_open[r]:
            self.pend_open[r] = False
            self._count(self.rep_of[r], self.node_of[r], 0, -1, now, push)

    def expire(self, r: int, now: float, push: Push) -> None:
        if self.pend_open[r]:
            self.pend_open[r] = False
            self._count(self.rep_of[r], self.node_of[r], 0, -1, now, push)

    def complete(self, r: int, now: float, push: Push) -> None:
        self._count(self.rep_of[r], self.node_of[r], -1, -1 if self.pend_open[r] else 0, now, push)
        self.pend_open[r] = False
