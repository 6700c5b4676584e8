"""Node dynamics of the routing simulator, in virtual time (helper of benches/routing_sim.py).

The model is zmlcore.fleet.perfmodel.SimProfile (the live sim node's) and the reference's: admit while
fewer than ``maxc`` sequences; FIFO prefill one at a time at ``prefill_tps``, pausing decode;
first token at prefill end; then O-1 decode steps of ``(1 + 0.02 (b-1)) / decode_tps`` seconds
for a batch of b. Decode progress is a per-node virtual clock (tokens per sequence), so an event
costs O(log b). ``predict_ttft`` runs the exact dynamics forward on a copy (the oracle).
"""

from __future__ import annotations

import heapq
from collections import deque

from zmlcore.fleet.perfmodel import SimProfile

EPS = 1e-9


class SimNode:
    __slots__ = (
        "idx", "name", "prof", "pf", "dec", "pen", "maxc", "cost", "admitted", "waitq", "prefq",
        "prefq_tok", "waitq_tok", "cur", "cur_end", "decoding", "vt", "last_t", "ver", "outstanding",
        "busy_since", "busy", "done_in_window", "tokens_in_window",
    )

    def __init__(self, idx: int, name: str, prof: SimProfile) -> None:
        self.idx = idx
        self.name = name
        self.prof = prof
        self.pf = prof.prefill_tps
        self.dec = prof.decode_tps
        self.pen = prof.batch_penalty
        self.maxc = prof.max_concurrency
        self.cost = prof.cost_per_hour
        self.admitted = 0
        self.waitq: deque[int] = deque()
        self.prefq: deque[int] = deque()
        self.prefq_tok = 0.0
        self.waitq_tok = 0.0
        self.cur = -1
        self.cur_end = 0.0
        self.decoding: list[tuple[float, int]] = []
        self.vt = 0.0
        self.last_t = 0.0
        self.ver = 0
        self.outstanding = 0
        self.busy_since = 0.0
        self.busy = 0.0
        self.done_in_window = 0
        self.tokens_in_window = 0

    def step(self, b: int) -> float:
        return (1.0 + self.pen * (b - 1)) / self.dec

    def advance(self, now: float) -> None:
        if self.cur < 0 and self.decoding:
            self.vt += (now - self.last_t) / self.step(len(self.decoding))
        self.last_t = now

    def lower_bound(self, now: float, p_new: float) -> float:
        """Every prefill queued ahead (FIFO) runs before the new request's."""
        rem = self.cur_end - now if self.cur >= 0 else 0.0
        return rem + (self.prefq_tok + self.waitq_tok + p_new) / self.pf

    def predict_ttft(self, now: float, p_new: float, P: list[int], O: list[int], bound: float = float("inf")) -> float:
        """Exact TTFT of a request arriving now (no later arrivals), by forward simulation;
        gives up (returns inf) once the TTFT is known to exceed ``bound``."""
        pf = self.pf
        if self.admitted < self.maxc:
            rem = self.cur_end - now if self.cur >= 0 else 0.0
            return rem + (self.prefq_tok + p_new) / pf
        dec = list(self.decoding)
        vt = self.vt
        if self.cur < 0 and dec:
            vt += (now - self.last_t) / self.step(len(dec))
        t = now
        prefq = deque(self.prefq)
        waitq = list(self.waitq)
        waitq.append(-1)
        wi = 0
        admitted = self.admitted
        cur = self.cur if self.cur >= 0 else -2  # -2: no prefill running; -1 is the new request
        cur_end = self.cur_end
        maxc = self.maxc
        while True:
            if cur >= 0:
                t = cur_end
                o = O[cur] - 1
                if o > 0:
                    heapq.heappush(dec, (vt + o, cur))
                else:
                    admitted -= 1
                cur = -2
            while admitted < maxc and wi < len(waitq):
                admitted += 1
                prefq.append(waitq[wi])
                wi += 1
            if prefq:
                r = prefq.popleft()
                if r == -1:
                    return t + p_new / pf - now
                cur = r
                cur_end = t + P[r] / pf
                continue
            cur = -2
            fin = dec[0][0]
            t += (fin - vt) * self.step(len(dec))
            if t - now > bound:
                return float("inf")
            vt = fin
            while dec and dec[0][0] <= vt + EPS:
                heapq.heappop(dec)
                admitted -= 1
