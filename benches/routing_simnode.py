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
    its root (a touch lists the chain deepest first, as vLLM frees a request's blocks tail
    first). A hit is the longest cached prefix in whole blocks, never the whole prompt (the
    engine computes at least its last token). ``store`` returns the units it stored and
    evicted: the engine's KV events (the precise fidelity's source).

    Layout: unit -> number of its last touch, and the touches oldest first (eviction walks
    them, skipping units touched again since): the exact LRU order of an ``OrderedDict`` moved
    unit by unit, at a C-level ``dict.update`` per touch.
    """

    __slots__ = ("gen", "log", "log_units", "touches", "cap", "bu")

    UNIT = 16

    def __init__(self, block_tokens: int, cap_tokens: int) -> None:
        self.gen: dict[int, int] = {}
        self.log: deque[list] = deque()  # [touch, units deepest first, next position]
        self.log_units = 0
        self.touches = 0
        self.bu = max(1, block_tokens // self.UNIT)  # units per engine block
        self.cap = cap_tokens // self.UNIT

    def __len__(self) -> int:
        return len(self.gen)

    def depth(self, units: list[int]) -> int:
        """Leading units cached (the set is prefix-closed: bisection)."""
        held = self.gen
        n = len(units)
        if not n or units[0] not in held:
            return 0
        if units[-1] in held:
            return n
        lo, hi = 1, n - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            if units[mid] in held:
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
        gen = self.gen
        d = min(self.depth(units), n)
        self.touches += 1
        t = self.touches
        chain = units[:n]
        gen.update(zip(chain, repeat(t)))
        self.log.append([t, chain[::-1], 0])
        self.log_units += n
        over = len(gen) - self.cap
        if over > 0:
            self._evict(over)
        if self.log_units > 2 * len(gen) + 4096:
            self._compact()
        return n - d, max(0, over)

    def _evict(self, k: int) -> None:
        gen, log = self.gen, self.log
        while k > 0 and log:
            entry = log[0]
            t, us, i = entry
            end = len(us)
            while i < end and k > 0:
                u = us[i]
                i += 1
                if gen.get(u) == t:
                    del gen[u]
                    k -= 1
            if i >= end:
                log.popleft()
                self.log_units -= end
            else:
                entry[2] = i

    def _compact(self) -> None:
        gen = self.gen
        kept: deque[list] = deque()
        total = 0
        for t, us, i in self.log:
            live = [u for u in us[i:] if gen.get(u) == t]
            if live:
                kept.append([t, live, 0])
                total += len(live)
        self.log = kept
        self.log_units = total
