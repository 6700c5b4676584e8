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
from itertools import repeat

from zmlcore.fleet.perfmodel import SimProfile

EPS = 1e-9


class SimNode:
    __slots__ = (
        "idx", "name", "prof", "pf", "dec", "pen", "maxc", "cost", "admitted", "waitq", "prefq",
        "prefq_tok", "waitq_tok", "cur", "cur_end", "decoding", "vt", "last_t", "ver", "outstanding",
        "busy_since", "busy", "done_in_window", "tokens_in_window", "cache",
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
        #: the engine's prefix cache (shared-prefix workloads), else None
        self.cache: EngineCache | None = None

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


class EngineCache:
    """A simulated engine's prefix cache (vLLM's automatic prefix caching, in 16-token units).

    ``units`` are a prompt's chain (benches/routing_simworkload.py): unit ``i`` stands for its
    first ``16 (i + 1)`` tokens. The cache holds whole blocks of ``block`` tokens (a multiple
    of 16), at most ``cap`` units, least recently used evicted first, a chain's tail before
    its root (a touch moves the chain to the end deepest first, as vLLM frees a request's
    blocks tail first). A hit is the longest cached prefix in whole blocks, never the whole
    prompt (the engine computes at least its last token). ``on_evict(n_units)`` and
    ``on_store(n_units)`` see the engine's KV events (the precise fidelity's source).
    """

    __slots__ = ("lru", "cap", "bu", "on_evict", "on_store")

    UNIT = 16

    def __init__(self, block_tokens: int, cap_tokens: int) -> None:
        from collections import OrderedDict

        self.lru: OrderedDict[int, None] = OrderedDict()
        self.bu = max(1, block_tokens // self.UNIT)  # units per engine block
        self.cap = cap_tokens // self.UNIT

    def depth(self, units: list[int]) -> int:
        """Leading units cached (the set is prefix-closed: bisection)."""
        lru = self.lru
        n = len(units)
        if not n or units[0] not in lru:
            return 0
        if units[-1] in lru:
            return n
        lo, hi = 1, n - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if units[mid] in lru:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def cached_tokens(self, units: list[int], prompt_tokens: int) -> int:
        d = self.depth(units) // self.bu * self.bu * self.UNIT
        if d >= prompt_tokens:
            d = (prompt_tokens - 1) // (self.bu * self.UNIT) * self.bu * self.UNIT
        return max(0, d)

    def store(self, units: list[int]) -> tuple[int, int]:
        """The engine computed (or reused) these blocks: cache them, most recently used.
        Returns (units stored, units evicted)."""
        n = len(units) // self.bu * self.bu  # whole blocks only
        if not n:
            return 0, 0
        lru = self.lru
        d = min(self.depth(units), n)
        new = units[d:n]
        if new:
            lru.update(zip(reversed(new), repeat(None)))
        move = lru.move_to_end
        for k in reversed(units[:d]):
            move(k)
        over = len(lru) - self.cap
        if over > 0:
            pop = lru.popitem
            for _ in range(over):
                pop(last=False)
        return len(new), max(0, over)
