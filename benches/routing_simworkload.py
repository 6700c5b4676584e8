"""Shared-prefix workloads of the routing simulator (helper of benches/routing_sim.py).

A prompt is a sequence of *segments* (a system prompt, a user turn, an assistant reply, a tool
result...), each a number of tokens with its own bytes per token. Two views are built from it:

* the **engine's** (the simulated node's cache, the truth): a chain of 16-token units, unit
  ``i`` standing for the prompt's first ``16 (i + 1)`` tokens (two prompts share unit ``i``
  exactly when their segments agree that far), hashed incrementally per session;
* the **router's**: the prompt's bytes (each segment's bytes are fixed pseudo-random content,
  ``tokens x bytes_per_token`` long), keyed by ``zmlcore.policy.prefix.chain_from_bytes``, the
  router's own code, with the body size giving its token estimate. The router never sees the
  units or the token counts.

Workloads (``make_workload``), each open-loop so every policy sees the same trace:

* ``chat`` — multi-turn conversations: a system prompt (8, Zipf 1.1, ~600 tokens), then turns
  of a user message (lognormal median 120 tokens) and the assistant's reply (the request's
  output, median 200); the next turn comes a think time (exponential, mean 20 s) later and
  repeats the whole conversation; ~6 turns, ending before 8,192 tokens of context.
* ``agent`` — agent tasks on a few long tool prompts: 24 apps, each with a tool prompt (lognormal
  median 3,000 tokens, [1,000, 8,000]), popularity Zipf 1.0; a task is ~4 steps, each adding a
  short tool result (median 150 tokens) and the previous output (median 100), 1-3 s apart.
* ``rag`` — a handful of system prompts (8, Zipf 1.1, ~1,500 tokens) + retrieved documents
  (unique, median 1,500) + a question (median 40): one request each, Poisson.
* ``noshare`` — the reference workload (lognormal prompts, median 500, sigma 1.0; nothing
  shared): the control.
* ``hot`` — ``agent`` with one app taking ~60% of the traffic (Zipf 2.0 over 24 apps): affinity
  alone would pile onto one node (the load-imbalanced case).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from itertools import repeat
from dataclasses import dataclass, field

import numpy as np

#: Tokens per engine unit: the smallest block size of the fleet (vLLM's 16); nodes with larger
#: blocks count whole multiples of it.
UNIT = 16
#: Bytes per token of a segment: lognormal median and sigma across segments (English ~4).
BYTES_PER_TOKEN, BYTES_SIGMA = 4.0, 0.25
MAX_CONTEXT = 8192
CACHE_WORKLOADS = ("chat", "agent", "rag", "noshare", "hot")


def _mix(h: int, x: int) -> int:
    return hash((h, x))  # tuples of ints hash the same in every process (no PYTHONHASHSEED)


@dataclass
class Prompt:
    """One request's prompt in both views."""

    tokens: int
    #: engine units of the prompt, and of the prompt followed by the reply (cached at completion)
    units: list[int]
    units_out: list[int]
    #: the router's view: the prompt's bytes and the JSON envelope around them
    data: bytes
    envelope: int
    session: int = -1


@dataclass
class Stream:
    """A sequence of prompts that extend each other (a conversation, an agent task), built as
    it goes: the running unit hash per segment, the units so far, the bytes so far."""

    h: int = 0
    pos: int = 0
    units: list[int] = field(default_factory=list)
    parts: list[bytes] = field(default_factory=list)

    def extend(self, seg_id: int, tokens: int, data: bytes) -> None:
        h = _mix(self.h, seg_id)
        start = self.pos
        first = (start // UNIT + 1) * UNIT
        self.units.extend(map(hash, zip(repeat(h), range(first - start, tokens + 1, UNIT))))
        self.h = h
        self.pos = start + tokens
        self.parts.append(data)

    def copy(self) -> Stream:
        return Stream(self.h, self.pos, list(self.units), list(self.parts))


class Segments:
    """Segment ids, bytes per token and content: a slice of a fixed random pool at an offset
    and with a bytes-per-token ratio both derived from the id (so content is fixed by the id)."""

    POOL = np.random.default_rng(20261202).bytes(1 << 23)
    RATIOS = np.clip(np.random.default_rng(7).lognormal(math.log(BYTES_PER_TOKEN), BYTES_SIGMA, 1 << 16),
                     1.5, 12.0).tolist()

    def __init__(self, seed: int) -> None:
        self.next_id = (seed % 1000) * 10_000_000 + 1

    def new(self) -> int:
        self.next_id += 1
        return self.next_id

    def data(self, seg_id: int, tokens: int) -> bytes:
        h = _mix(seg_id, 0x5EED)
        n = max(1, int(tokens * self.RATIOS[h & 0xFFFF]))
        off = (h >> 16) % (len(self.POOL) - n)
        return self.POOL[off:off + n]


@dataclass
class Plan:
    """The trace: per request its arrival, prompt and output lengths, and how to build its
    prompt: (stream id or -1, segments it adds [(seg id, tokens, shared)], root or -1)."""

    arr: list[float]
    P: list[int]
    O: list[int]
    steps: list[tuple[int, list[tuple[int, int, bool]], int]]
    mean_p: float
    mean_o: float
    #: mean tokens a request adds to what its stream (or its shared root) already had: what it
    #: would prefill with perfect prefix reuse
    mean_new: float = 0.0
    #: shared roots (system / tool prompts): (seg id, tokens)
    roots: list[tuple[int, int]] = field(default_factory=list)
    segs: Segments | None = None


class Draws:
    """Pre-drawn variates consumed in order (numpy's per-call overhead dominates otherwise)."""

    def __init__(self, rng: np.random.Generator, size: int) -> None:
        self.rng = rng
        self.size = size
        self._norm: Iterator[float] = iter(())
        self._unif: Iterator[float] = iter(())

    def normal(self) -> float:
        try:
            return next(self._norm)
        except StopIteration:
            self._norm = iter(self.rng.standard_normal(self.size).tolist())
            return next(self._norm)

    def uniform(self) -> float:
        try:
            return next(self._unif)
        except StopIteration:
            self._unif = iter(self.rng.random(self.size).tolist())
            return next(self._unif)

    def lognorm(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, round(median * math.exp(sigma * self.normal())))))

    def exponential(self, mean: float) -> float:
        return -mean * math.log(1.0 - self.uniform())

    def choice(self, cdf: list[float]) -> int:
        u = self.uniform()
        for i, c in enumerate(cdf):
            if u < c:
                return i
        return len(cdf) - 1


def _zipf_cdf(n: int, a: float) -> list[float]:
    w = 1.0 / np.arange(1, n + 1) ** a
    return np.cumsum(w / w.sum()).tolist()


def make_workload(kind: str, n: int, seed: int, rate: Callable[[float, float, float], float]) -> Plan:
    """The first ``n`` requests of a ``kind`` trace arriving at ``rate(mean prompt, mean
    output, mean new tokens)`` requests/s (a share of a capacity that depends on the means)."""
    rng = np.random.default_rng([seed, 7])
    d = Draws(rng, 1 << 16)
    segs = Segments(seed)
    reqs: list[tuple[float, int, list[tuple[int, int, bool]], int, int, int]] = []  # t, stream, adds, root, O, P
    roots: list[tuple[int, int]] = []
    if kind == "noshare":
        P = np.clip(np.rint(rng.lognormal(math.log(500), 1.0, n)), 16, 8192).astype(int)
        O = np.clip(np.rint(rng.lognormal(math.log(200), 0.8, n)), 1, 2048).astype(int)
        mp, mo = float(P.mean()), float(O.mean())
        t = np.cumsum(rng.exponential(1.0 / rate(mp, mo, mp), n))
        steps = [(-1, [(segs.new(), int(p), False)], -1) for p in P]
        return Plan(t.tolist(), P.tolist(), O.tolist(), steps, mp, mo, mp, [], segs)
    if kind == "rag":
        roots = [(segs.new(), d.lognorm(1500, 0.3, 600, 3000)) for _ in range(8)]
        cdf = _zipf_cdf(8, 1.1)
        P, O, steps = [], [], []
        for i in range(n):
            k = d.choice(cdf)
            doc, q = d.lognorm(1500, 0.6, 100, 5000), d.lognorm(40, 0.5, 5, 400)
            P.append(roots[k][1] + doc + q)
            O.append(d.lognorm(200, 0.8, 1, 2048))
            steps.append((-1, [(segs.new(), doc, False), (segs.new(), q, False)], k))
        mp, mo = float(np.mean(P)), float(np.mean(O))
        mn = mp - float(np.mean([roots[k][1] for _s, _a, k in steps]))
        t = np.cumsum(rng.exponential(1.0 / rate(mp, mo, mn), n))
        return Plan(t.tolist(), P, O, steps, mp, mo, mn, roots, segs)
    # chat / agent / hot: streams (conversations, tasks) that start at Poisson times
    if kind == "chat":
        roots = [(segs.new(), d.lognorm(600, 0.5, 100, 2000)) for _ in range(8)]
        cdf = _zipf_cdf(8, 1.1)
    elif kind in ("agent", "hot"):
        roots = [(segs.new(), d.lognorm(3000, 0.5, 1000, 8000)) for _ in range(24)]
        cdf = _zipf_cdf(24, 1.0 if kind == "agent" else 2.0)
    else:
        raise ValueError(f"unknown workload {kind!r}")
    streams: list[tuple[int, list[tuple[float, list[tuple[int, int, bool]], int]]]] = []
    total = 0
    while total < n * 1.3 + 50:
        k = d.choice(cdf)
        ctx = roots[k][1]
        turns: list[tuple[float, list[tuple[int, int, bool]], int]] = []
        dt = 0.0
        prev_out = 0
        while True:
            if kind == "chat":
                add = d.lognorm(120, 0.8, 8, 2000)
                out = d.lognorm(200, 0.8, 1, 1024)
            else:
                add = d.lognorm(150, 0.8, 8, 2000)
                out = d.lognorm(100, 0.8, 1, 1024)
            if ctx + prev_out + add + out > MAX_CONTEXT and turns:
                break
            adds = ([(segs.new(), prev_out, False)] if prev_out else []) + [(segs.new(), add, False)]
            ctx += prev_out + add
            turns.append((dt, adds, out))
            prev_out = out
            if kind == "chat":
                if d.uniform() < 1 / 6:
                    break
                dt += d.exponential(20.0)
            else:
                if d.uniform() < 1 / 4:
                    break
                dt += 1.0 + d.exponential(1.0)
        streams.append((k, turns))
        total += len(turns)
    # the means set the rate; sessions start at lam / E[turns] per second
    p_all: list[int] = []
    new_all: list[int] = []
    for k, turns in streams:
        ctx = roots[k][1]
        for _dt, adds, _out in turns:
            add = sum(a[1] for a in adds)
            ctx += add
            p_all.append(ctx)
            new_all.append(add)
    mean_p = float(np.mean(p_all))
    mean_new = float(np.mean(new_all))
    mean_o = float(np.mean([tt[2] for _k, turns in streams for tt in turns]))
    per = total / len(streams)
    starts = np.cumsum(rng.exponential(per / rate(mean_p, mean_o, mean_new), len(streams)))
    for sid, ((k, turns), t0) in enumerate(zip(streams, starts)):
        ctx = roots[k][1]
        for dt, adds, out in turns:
            ctx += sum(a[1] for a in adds)
            reqs.append((float(t0 + dt), sid, adds, k, out, ctx))
    reqs.sort(key=lambda x: x[0])
    reqs = reqs[:n]
    return Plan([x[0] for x in reqs], [x[5] for x in reqs], [x[4] for x in reqs],
                [(x[1], x[2], x[3]) for x in reqs], mean_p, mean_o, mean_new, roots, segs)


class Builder:
    """Builds each request's :class:`Prompt` at its arrival, in arrival order (a stream's
    state is kept between its requests and dropped after its last)."""

    def __init__(self, plan: Plan, seed: int) -> None:
        self.plan = plan
        self.segs = plan.segs or Segments(seed)
        self.roots: list[Stream] = []
        for sid, tokens in plan.roots:
            s = Stream()
            s.extend(sid, tokens, self.segs.data(sid, tokens))
            self.roots.append(s)
        self.live: dict[int, Stream] = {}
        #: the reply segment of each request that has a next one in its stream (its first addition)
        self.reply: dict[int, int] = {}
        prev: dict[int, int] = {}
        for r, (stream, adds, _root) in enumerate(plan.steps):
            if stream >= 0:
                if stream in prev:
                    self.reply[prev[stream]] = adds[0][0]
                prev[stream] = r
        self.rng = random.Random(seed * 31 + 5)

    def build(self, r: int) -> Prompt:
        stream, adds, root = self.plan.steps[r]
        s = self.live.pop(stream, None) if stream >= 0 else None
        if s is None:
            s = self.roots[root].copy() if root >= 0 else Stream()
        for seg_id, tokens, _shared in adds:
            s.extend(seg_id, tokens, self.segs.data(seg_id, tokens))
        units = list(s.units)
        reply = self.reply.get(r)
        if reply is not None:
            t = Stream(s.h, s.pos, list(s.units), [])
            t.extend(reply, self.plan.O[r], b"")
            units_out = t.units
            self.live[stream] = s
        else:
            units_out = units
        env = self.rng.randint(80, 240) + 60 * (1 + len(adds))  # JSON envelope, roles, escaping
        return Prompt(s.pos, units, units_out, b"".join(s.parts), env, stream)
