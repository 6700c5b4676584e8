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

With ``tokens`` the replicas also count each pending request's uncached prompt tokens as
estimated at dispatch (``NodeView.pending_tokens``), shared like the counters.

:class:`SimIndexes` is the replicas' prefix indexes (``zmlcore.policy.prefix.PrefixIndex``, one
per replica, as each live replica keeps its own): what a replica learns (a dispatch it records,
an engine report it corrects with, a node's KV events) reaches the others after the same NATS
lag; the engine's own events reach every replica after the bridge's lag.

Events go through ``push(t, kind, a, b)`` (the simulator's heap): ``DELTA`` (replica a receives
delta b), ``EXPIRE`` (request a's pending ends) and ``SHARE`` (replica a receives index update b).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from zmlcore.messages import KvBlockRemoved, KvBlockStored, KvEventBatch
from zmlcore.policy import NodeView
from zmlcore.policy.prefix import KeyChain, PrefixIndex

DELTA, EXPIRE, SHARE = 3, 4, 5
Push = Callable[[float, int, int, int], None]


class SimRouters:
    def __init__(self, views: list[list[NodeView]], n: int, *, share: bool = True,
                 lag: tuple[float, float] | None = None, local: bool = True, count_pending: bool = True,
                 expiry: float = 0.0, seed: int = 0, tokens: bool = False) -> None:
        self.views = views  # views[replica][node]
        self.tokens = tokens
        if tokens:
            for rep in views:
                for v in rep:
                    v.pending_tokens = 0.0
        self.tok = [0.0] * n
        self.share = share
        self.lag = lag
        self.local = local
        self.count_pending = count_pending
        self.expiry = expiry
        self.rnd = random.Random(seed)
        self.rep_of = [0] * n
        self.node_of = [0] * n
        self.pend_open = [False] * n
        self._deltas: dict[int, tuple[int, int, int, float]] = {}
        self._next = 0

    def _count(self, ri: int, idx: int, d_out: int, d_pend: int, now: float, push: Push, d_tok: float = 0.0) -> None:
        if not self.local:
            return
        for rj in range(len(self.views)):
            if rj != ri and not self.share:
                continue
            if rj == ri or self.lag is None:
                self.apply(rj, idx, d_out, d_pend, d_tok)
            else:
                self._next += 1
                self._deltas[self._next] = (idx, d_out, d_pend, d_tok)
                push(now + self.rnd.uniform(*self.lag), DELTA, rj, self._next)

    def apply(self, rj: int, idx: int, d_out: int, d_pend: int, d_tok: float = 0.0) -> None:
        v = self.views[rj][idx]
        if d_tok and self.tokens:
            v.set_counts(v.outstanding + d_out, v.pending + d_pend, max(0.0, (v.pending_tokens or 0.0) + d_tok))
            return
        if d_out:
            v.outstanding += d_out
        if d_pend:
            v.pending += d_pend

    def deliver(self, rj: int, key: int) -> None:
        """A peer's delta reaches replica ``rj`` (a DELTA event)."""
        self.apply(rj, *self._deltas.pop(key))

    def dispatch(self, r: int, ri: int, idx: int, streamed: bool, est_ttft: float, now: float, push: Push,
                 tokens: float = 0.0) -> None:
        self.rep_of[r] = ri
        self.node_of[r] = idx
        self.pend_open[r] = self.count_pending
        self.tok[r] = tokens if self.tokens and self.count_pending else 0.0
        self._count(ri, idx, 1, 1 if self.count_pending else 0, now, push, self.tok[r])
        if self.count_pending and self.expiry and not streamed:
            push(now + self.expiry * est_ttft, EXPIRE, r, 0)

    def first_token(self, r: int, streamed: bool, now: float, push: Push) -> None:
        """Prefill of r ended: only a stream shows it to the router."""
        if streamed and self.pend_open[r]:
            self.pend_open[r] = False
            self._count(self.rep_of[r], self.node_of[r], 0, -1, now, push, -self.tok[r])

    def expire(self, r: int, now: float, push: Push) -> None:
        if self.pend_open[r]:
            self.pend_open[r] = False
            self._count(self.rep_of[r], self.node_of[r], 0, -1, now, push, -self.tok[r])

    def complete(self, r: int, now: float, push: Push) -> None:
        was = self.pend_open[r]
        self._count(self.rep_of[r], self.node_of[r], -1, -1 if was else 0, now, push, -self.tok[r] if was else 0.0)
        self.pend_open[r] = False


class SimIndexes:
    """Every replica's PrefixIndex, and what reaches it when (see the module docstring).

    ``fidelity``: "approximate" (dispatches only), "reported" (+ the engine's cached-token
    reports), "precise" (+ the engine's KV events, after ``event_lag`` seconds).
    """

    def __init__(self, n_replicas: int, node_ids: list[str], states: list, *, fidelity: str,
                 lag: tuple[float, float] | None, event_lag: tuple[float, float], seed: int) -> None:
        self.indexes = [PrefixIndex() for _ in range(n_replicas)]
        for idx in self.indexes:
            for st in states:
                idx.update_node(st)
        self.ids = node_ids
        self.fidelity = fidelity
        self.lag = lag
        self.event_lag = event_lag
        self.rnd = random.Random(seed)
        self._pending: dict[int, tuple] = {}
        self._next = 0

    def _send(self, ri: int | None, now: float, push: Push, item: tuple) -> None:
        """Apply ``item`` at replica ``ri`` now and at the others after the lag (``ri`` None:
        an engine event, every replica after the event lag)."""
        for rj in range(len(self.indexes)):
            if rj == ri:
                self.apply(rj, item, now)
                continue
            lag = self.event_lag if ri is None else self.lag
            if lag is None:
                self.apply(rj, item, now)
                continue
            self._next += 1
            self._pending[self._next] = item
            push(now + self.rnd.uniform(*lag), SHARE, rj, self._next)

    def deliver(self, rj: int, key: int, now: float) -> None:
        self.apply(rj, self._pending.pop(key), now)

    def apply(self, rj: int, item: tuple, now: float) -> None:
        idx = self.indexes[rj]
        kind = item[0]
        if kind == "record":
            idx.record(item[1], item[2], now)
        elif kind == "correct":
            idx.correct(item[1], item[2], item[3], now, item[4])
        else:  # an engine's KV event batch
            idx.apply_events(item[1], item[2], now)

    def record(self, ri: int, node: int, chain: KeyChain, now: float, push: Push) -> None:
        self._send(ri, now, push, ("record", self.ids[node], chain))

    def correct(self, ri: int, node: int, chain: KeyChain, cached: int, prompt: int, now: float, push: Push) -> None:
        if self.fidelity != "approximate":
            self._send(ri, now, push, ("correct", self.ids[node], chain, cached, prompt))

    def engine_event(self, node: int, block: int, stored_tokens: int, evicted_tokens: int, now: float,
                     push: Push) -> None:
        """The node's engine (``block``-token blocks) stored / evicted that many tokens: its
        KV events, one hash per block (the index counts them)."""
        if self.fidelity != "precise":
            return
        ev: list = []
        if stored_tokens:
            ev.append(KvBlockStored(block_hashes=[0] * max(1, round(stored_tokens / block)), block_size=block))
        if evicted_tokens:
            ev.append(KvBlockRemoved(block_hashes=[0] * max(1, round(evicted_tokens / block))))
        batch = KvEventBatch(node_id=self.ids[node], events=ev, block_size=block)
        self._send(None, now, push, ("events", self.ids[node], batch))
