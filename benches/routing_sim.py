"""Routing-quality simulator: the reference fleet in virtual time, routed by the router's own decision.

    python benches/routing_sim.py                      # defaults: 20k requests, 1 seed, 50/80/95/110%
    python benches/routing_sim.py --requests 200000 --first-seed 1 --seeds 3 --jobs 1 --loads 50,80,95 \
        --workloads poisson --policies oracle,least_busy,latency --save benches/routing_sim_results.json --append
    python benches/routing_sim.py --load-results benches/routing_sim_results.json   # reprint saved results

A 200k-request run takes 10-40 s of CPU for a ZML policy below 100% load; the oracle at 110%
(exact forward simulation of long queues) takes minutes. Tuning seeds were 1001-1004; the
reported ones are 1-3 for the reference workloads (docs/benchmarks.md "Routing quality
(simulation)") and 21-23 for the shared-prefix ones ("Cache-aware routing (issue 19)").

Fleet (../shared/reference/routing-frontier.md from the repo root): 2xH100, 1xA100, 2xMI300X,
1xGaudi2, 1xInf2, each a zmlcore.fleet.perfmodel.SimProfile (the live sim node's model; dynamics in
benches/routing_simnode.py). Workload: lognormal prompts (median 500, sigma 1.0, [16, 8192]) and
outputs (median 200, sigma 0.8, [1, 2048]); Poisson or 2-state MMPP arrivals (burst 3x base,
on/off 10 s / 40 s). Every policy of one (workload, load, seed) sees the same trace. The ZML
policies run through zmlcore.policy.admission.admit (choose_node under the admission bound, the
router's call, with its prefix index on shared-prefix workloads) over a FleetIndex of NodeViews
fed what the router has: a polled NodeState every 5 s (+/-20% jitter), router-local outstanding/pending
counters (pending ends at the first token of a stream, at the estimated one for a plain reply),
the body-size prompt estimate, the admission bound, and peers' counters after a NATS lag
(benches/routing_simrouter.py).

Hidden speeds (issue 28): ``--hidden learn,told`` draws each node's true speed 0.3-3x its type's
(drifting ``--drift``); ``learn`` tells the router only the profile and feeds the health
service's learner (zmlcore.fleet.learn) what a router sees of each streamed request, ``told``
polls the true speeds (docs/benchmarks.md "Learned speeds in simulation"). Tuning seeds 1001-1003;
reported 21-23.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys
import time
from collections import defaultdict
from multiprocessing import Pool
from pathlib import Path
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_simnode import EPS, EngineCache, SimNode  # noqa: E402
from routing_simrouter import DELTA, EXPIRE, SHARE, SimIndexes, SimRouters  # noqa: E402
from routing_simworkload import CACHE_WORKLOADS, Builder, Prompt, make_workload  # noqa: E402

from zmlcore.config import PolicyConfig, RouterConfig  # noqa: E402
from zmlcore.messages import NodeState  # noqa: E402
from zmlcore.errors import QueueFullError  # noqa: E402
from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState, builtin_policy  # noqa: E402
from zmlcore.policy.admission import admit  # noqa: E402
from zmlcore.policy.estimate import NONSTREAM_PENDING_FOR, prompt_tokens_from_body  # noqa: E402
from zmlcore.policy.prefix import KV_DEFAULTS, KeyChain, chain_from_bytes, model_seed  # noqa: E402
from zmlcore.policy.resolve import ResolvedPolicy  # noqa: E402
from zmlcore.fleet.perfmodel import SimProfile  # noqa: E402
from zmlcore.fleet.learn import observe_sample, prior_speeds, published  # noqa: E402
from zmlcore.messages.speeds import SpeedSample  # noqa: E402

FLEET = [
    ("h100-1", "nvidia_h100"), ("h100-2", "nvidia_h100"), ("a100-1", "nvidia_a100"),
    ("mi300x-1", "amd_mi300x"), ("mi300x-2", "amd_mi300x"), ("gaudi2-1", "intel_gaudi2"),
    ("inf2-1", "aws_inferentia2"),
]
MEAN_P, MEAN_O = 816.0, 274.0
TARGET_S = 0.5
MODEL = "m"
#: The router's staleness limit (RouterConfig's default): polls every 5 s +/-20% never reach it.
STALE_AFTER_S = RouterConfig().stale_after_s
#: Characters of prompt text per token: median and lognormal sigma across requests (English
#: prose ~4, code and other scripts lower or higher), and the chat-completions JSON envelope
#: (model, role, max_tokens, stream flag and escaping) in bytes.
CHARS_PER_TOKEN = 4.0
CHARS_PER_TOKEN_SIGMA = 0.25
ENVELOPE_BYTES = (80, 240)


def capacity_rps(mean_p: float = MEAN_P, mean_o: float = MEAN_O, profs: list[SimProfile] | None = None) -> float:
    """The fleet's saturation throughput (req/s) when every prompt token is prefilled: with
    shared-prefix workloads the offered load is a share of this no-cache capacity, the load
    today's policy sees. ``profs``: the nodes' true profiles (hidden speeds), else the types'."""
    return sum(p.capacity_rps(mean_p, mean_o) for p in (profs or [SimProfile.for_type(t) for _, t in FLEET]))


#: Hidden speeds (--hidden): each node's true speed is its type's times a factor drawn
#: log-uniformly in HIDDEN_RANGE, wandering +/- drift (a sine of period DRIFT_PERIOD_S, a random
#: phase per node). "learn": the router is told only the type's profile and routes on what the
#: health service's learner (zmlcore.fleet.learn) makes of its streamed requests' samples;
#: "told": the same fleet with every poll telling the true current speeds (perfect knowledge).
HIDDEN_RANGE = (0.3, 3.0)
DRIFT_PERIOD_S = 600.0
DRIFT_EVERY_S = 10.0
DRIFT = 9  # event kind


def hidden_fleet(seed: int) -> tuple[list[float], list[float]]:
    """Per node: the true speed factor and the drift's phase (the same for both modes)."""
    rng = random.Random(seed * 7919 + 5)
    lo, hi = (math.log(x) for x in HIDDEN_RANGE)
    return [math.exp(rng.uniform(lo, hi)) for _ in FLEET], [rng.uniform(0, 2 * math.pi) for _ in FLEET]


#: KV memory an engine keeps for its running sequences' own tokens, per sequence slot: the
#: prefix cache gets the rest of its capacity (zmlcore.policy.prefix.KV_DEFAULTS).
RUNNING_RESERVE_TOKENS = 2048


def make_trace(n: int, lam: float, bursty: bool, seed: int) -> tuple[list[float], list[int], list[int]]:
    rng = np.random.default_rng(seed)
    P = np.clip(np.rint(rng.lognormal(math.log(500), 1.0, n)), 16, 8192).astype(int)
    O = np.clip(np.rint(rng.lognormal(math.log(200), 0.8, n)), 1, 2048).astype(int)
    if not bursty:
        arr = np.cumsum(rng.exponential(1.0 / lam, n))
    else:
        base = lam / 1.4  # on 20% of the time at 3x: 0.2*3b + 0.8*b = 1.4b
        out: list[float] = []
        t = 0.0
        on = rng.random() < 0.2
        while len(out) < n:
            dur = rng.exponential(10.0 if on else 40.0)
            rate = base * (3.0 if on else 1.0)
            k = rng.poisson(rate * dur)
            out.extend(np.sort(t + rng.random(k) * dur).tolist())
            t += dur
            on = not on
        arr = np.array(out[:n])
    return arr.tolist(), P.tolist(), O.tolist()


def make_requests(P: list[int], seed: int, stream_share: float) -> tuple[list[int], list[bool]]:
    """What the router sees of each request: its body size in bytes (the prompt's text at a
    per-request chars-per-token ratio, plus the JSON envelope) and whether it streams. Drawn
    from their own generator so that arrivals and lengths stay those of ``make_trace``."""
    rng = np.random.default_rng([seed, 2])
    cpt = np.clip(rng.lognormal(math.log(CHARS_PER_TOKEN), CHARS_PER_TOKEN_SIGMA, len(P)), 1.5, 12.0)
    body = (np.asarray(P) * cpt + rng.integers(ENVELOPE_BYTES[0], ENVELOPE_BYTES[1], len(P))).astype(int)
    stream = rng.random(len(P)) < stream_share
    return body.tolist(), stream.tolist()


# --- policy specs -----------------------------------------------------------------------

def _zml(pol: ResolvedPolicy, **kw: Any) -> dict[str, Any]:
    spec = {"kind": "zml", "policy": pol, "replicas": 1, "share": True, "local": True, "pending": True, "poll": 5.0}
    spec.update(kw)
    return spec


WEIGHTED = ResolvedPolicy(
    "weighted", PolicyConfig(strategy="weighted", latency_weight=0.8, cost_weight=0.2), ()
)

POLICIES: dict[str, dict[str, Any]] = {
    "oracle": {"kind": "oracle"},
    "round_robin": _zml(builtin_policy("round_robin")),
    "least_busy": {"kind": "least_busy"},
    "p2c": {"kind": "p2c"},
    "latency": _zml(builtin_policy("latency")),
    "cost": _zml(builtin_policy("cost")),
    "availability": _zml(builtin_policy("availability")),
    "balanced": _zml(builtin_policy("balanced")),
    "weighted": _zml(WEIGHTED),
    # staleness variants of the latency policy
    "latency_fresh": _zml(builtin_policy("latency"), poll=0.0),
    "latency_poll_only": _zml(builtin_policy("latency"), local=False),
    "latency_poll_outstanding": _zml(builtin_policy("latency"), pending=False),
    "latency_r4_shared": _zml(builtin_policy("latency"), replicas=4, share=True),
    "latency_r4_lag1_5": _zml(builtin_policy("latency"), replicas=4, lag=(0.001, 0.005)),
    "latency_r4_lag10_50": _zml(builtin_policy("latency"), replicas=4, lag=(0.010, 0.050)),
    "latency_r4_noshare": _zml(builtin_policy("latency"), replicas=4, share=False),
}
DEFAULT_POLICIES = list(POLICIES)


def _cache(pol: ResolvedPolicy | None = None, fidelity: str = "reported", **kw: Any) -> dict[str, Any]:
    """A ZML policy with the prefix index (``fidelity``), as the router runs it: its pending
    requests count a mean prompt each (``tokens=True``: their uncached tokens, NodeView.pending_tokens)."""
    return _zml(pol or builtin_policy("latency"), cache=fidelity, **kw)


# cache-aware routing (shared-prefix workloads): the index at each fidelity, with replicas,
# with sessions, the default policy with the index, and the cache oracle
POLICIES.update({
    "cache": _cache(),
    "cache_approx": _cache(fidelity="approximate"),
    "cache_precise": _cache(fidelity="precise"),
    "cache_r4_lag1_5": _cache(replicas=4, lag=(0.001, 0.005)),
    "cache_session": _cache(session=True),
    "cache_balanced": _cache(builtin_policy("balanced")),
    "cache_tokens": _cache(tokens=True),
    # the sticky budget (strategies.latency): none, or fixed multiples of the recomputation
    # instead of the recomputation over (1 - rho_ref), for the comparison that chose it
    "cache_sticky0": _cache(sticky=0.0, sticky_load=False),
    "cache_sticky05": _cache(sticky=0.5, sticky_load=False),
    "cache_sticky1": _cache(sticky=1.0, sticky_load=False),
    "cache_sticky2": _cache(sticky=2.0, sticky_load=False),
    "cache_sticky4": _cache(sticky=4.0, sticky_load=False),
    "oracle_cache": {"kind": "oracle", "sticky": True},
})
CACHE_POLICIES = ["oracle_cache", "oracle", "round_robin", "latency", "cache", "cache_approx", "cache_precise",
                  "cache_r4_lag1_5", "cache_session", "cache_balanced"]


# --- one run ----------------------------------------------------------------------------

PREFILL, DECODE, POLL = 0, 1, 2  # and DELTA, EXPIRE (routing_simrouter)


def _state(node: SimNode, now: float) -> NodeState:
    return NodeState(
        node_id=node.name, accelerator_type=node.prof.accelerator, family=_family(node), endpoint="sim://",
        status="up", models=[MODEL], queue_running=node.admitted, queue_waiting=len(node.waitq),
        max_concurrency=node.maxc, prefill_tps=node.pf, decode_tps=node.dec, cost_per_hour=node.cost,
        health_score=100.0, updated_at=now, **_kv(node),
    )


def _kv(node: SimNode) -> dict[str, int]:
    """What health reads from vllm:cache_config_info (block size, all KV blocks)."""
    if node.cache is None:
        return {}
    bs, cap = KV_DEFAULTS[node.prof.accelerator]
    return {"kv_block_size": bs, "kv_blocks": cap // bs}


def _family(node: SimNode) -> str:
    from zmlcore.fleet.accelerators import ACCELERATORS

    return ACCELERATORS[node.prof.accelerator].family


#: What the simulated router knows, by default the live router's situation: the body-size
#: prompt estimate, half the requests streamed (the others hold ``pending`` for their estimated
#: TTFT, zml_router.node.pending.PendingHold) and the ``admission_ttft_s`` bound (RouterConfig's default).
DEFAULT_OPTS: dict[str, Any] = {"stream_share": 0.5, "estimate": "body",
                                "admission_s": RouterConfig().admission_ttft_s,
                                "pending_expiry": NONSTREAM_PENDING_FOR,
                                # the engine's KV events reach the routers through a ZMQ->NATS bridge
                                "event_lag": (0.005, 0.020),
                                "load_basis": "reuse"}


def run(policy: str, workload: str, load: float, seed: int, n: int, warm: int,
        opts: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = POLICIES[policy]
    if "sticky" in spec and spec["kind"] == "zml":
        from zmlcore.policy.strategies import latency as latency_strategy

        saved = latency_strategy.STICKY, latency_strategy.STICKY_LOAD
        latency_strategy.STICKY, latency_strategy.STICKY_LOAD = spec["sticky"], spec.get("sticky_load", True)
        try:
            return _run(policy, workload, load, seed, n, warm, opts)
        finally:
            latency_strategy.STICKY, latency_strategy.STICKY_LOAD = saved
    return _run(policy, workload, load, seed, n, warm, opts)


def _run(policy: str, workload: str, load: float, seed: int, n: int, warm: int,
         opts: dict[str, Any] | None = None) -> dict[str, Any]:
    o_ = {**DEFAULT_OPTS, **(opts or {})}
    spec = POLICIES[policy]
    cache_wl = workload in CACHE_WORKLOADS
    hidden = o_.get("hidden") or ""
    profs = [SimProfile.for_type(t) for _, t in FLEET]
    phases = [0.0] * len(FLEET)
    if hidden:
        factors, phases = hidden_fleet(seed)
        profs = [replace(p, prefill_tps=p.prefill_tps * f, decode_tps=p.decode_tps * f) for p, f in zip(profs, factors)]
    drift = float(o_.get("drift") or 0.0) if hidden else 0.0
    if o_.get("explore"):  # tuning: (EXPLORE_Z, EXPLORE_CAP) of zmlcore.policy.estimate
        from zmlcore.policy import estimate

        estimate.EXPLORE_Z, estimate.EXPLORE_CAP = o_["explore"]
    builder: Builder | None = None
    if cache_wl:
        # offered load: a share of the fleet's capacity with perfect prefix reuse (each request
        # prefills only what it adds to its conversation, task or shared prompt), or with
        # none ("nocache": every prompt token prefilled, the load today's policy sees)
        reuse = o_["load_basis"] == "reuse"
        plan = make_workload(workload, n, seed, lambda mp, mo, mn: load * capacity_rps(mn if reuse else mp, mo, profs))
        arr, P, O = plan.arr, plan.P, plan.O
        cap = capacity_rps(plan.mean_new if reuse else plan.mean_p, plan.mean_o, profs)
        cap_nocache = capacity_rps(plan.mean_p, plan.mean_o, profs)
        builder = Builder(plan, seed)
        _body, streamed = make_requests(P, seed, o_["stream_share"])
        est_p: list[int] = [0] * n  # the body-size estimate, at arrival (from the prompt's bytes)
    else:
        cap = cap_nocache = capacity_rps(profs=profs)
        arr, P, O = make_trace(n, load * cap, workload == "bursty", seed)
        body, streamed = make_requests(P, seed, o_["stream_share"])
        est_p = [prompt_tokens_from_body(b) for b in body] if o_["estimate"] == "body" else P
    bound = o_["admission_s"] or math.inf
    rnd = random.Random(seed * 7919 + 1)
    nodes = [SimNode(i, name, prof) for i, ((name, _t), prof) in enumerate(zip(FLEET, profs))]
    # the health service's learner (hidden == "learn"): one belief per node, fed the samples
    # of streamed requests (what a router sees), published at each poll
    book = [prior_speeds(t) for _, t in FLEET]
    seen_at: list[tuple[int, float]] = [(0, 0.0)] * n  # per request: inflight and prefill ahead at dispatch
    first_at = [0.0] * n
    # per replica and node, the prompt tokens it sent there (zml_router.node.relay's ``fed``),
    # and per request its running total at dispatch and at the first token, and its replica
    fed: list[list[float]] = []
    fed_at = [(0.0, 0.0, 0)] * n

    def told(nd: SimNode, now: float) -> NodeState:
        st = _state(nd, now)
        if hidden != "learn":
            return st
        est = published(book[nd.idx], now)
        return msgspec.structs.replace(st, prefill_tps=est.prefill_tps, decode_tps=est.decode_tps,
                                       prefill_sigma=est.prefill_sigma, decode_sigma=est.decode_sigma,
                                       speeds_confidence=est.confidence)
    if cache_wl:
        for nd in nodes:
            bs, kv = KV_DEFAULTS[nd.prof.accelerator]
            nd.cache = EngineCache(bs, kv - nd.maxc * RUNNING_RESERVE_TOKENS)
    #: prefill tokens of each request on its node: its uncached part (all of it without caches)
    U = list(P)
    cached = [0] * n  # tokens its node had cached when its prefill started (the truth)
    prompts: dict[int, Prompt] = {}
    chains: dict[int, KeyChain] = {}
    ttft = [math.nan] * n
    rejected = [False] * n
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    tw, te = arr[warm], arr[-1]
    kind = spec["kind"]

    # router replicas (ZML policies)
    R = spec.get("replicas", 1) if kind == "zml" else 0
    fed.extend([0.0] * len(nodes) for _ in range(R))
    reps: list[tuple[list[NodeView], FleetIndex, RoutingState]] = []
    for _ in range(R):
        views = [NodeView(told(nd, 0.0)) for nd in nodes]
        reps.append((views, FleetIndex(views), RoutingState()))
    local = spec.get("local", True)
    count_pending = spec.get("pending", True)
    poll = spec.get("poll", 5.0)
    fresh = kind == "zml" and poll == 0.0
    routers = SimRouters([v for v, _f, _s in reps], n, share=spec.get("share", True), lag=spec.get("lag"),
                         local=local, count_pending=count_pending, expiry=o_["pending_expiry"],
                         seed=seed * 7919 + 2, tokens=bool(spec.get("tokens")) and cache_wl)
    fidelity = spec.get("cache") if cache_wl else None
    indexes = SimIndexes(R, [nd.name for nd in nodes], [told(nd, 0.0) for nd in nodes], fidelity=fidelity or "",
                         lag=spec.get("lag"), event_lag=o_["event_lag"], seed=seed * 7919 + 3) if fidelity else None
    mseed = model_seed(MODEL)
    sessions: dict[int, str] = {}
    pred = [math.nan] * n  # the oracle's predicted TTFT, checked against the realised one
    if kind == "zml" and not fresh:
        for ri in range(R):
            for nd in nodes:
                seq += 1
                heapq.heappush(heap, (rnd.uniform(0, poll), seq, POLL, ri, nd.idx))
    pol: ResolvedPolicy | None = spec.get("policy")
    debug_err: list[list[tuple[float, float]]] | None = [[] for _ in nodes] if os.environ.get("ROUTING_SIM_DEBUG") else None
    if drift:
        heapq.heappush(heap, (DRIFT_EVERY_S, 0, DRIFT, 0, 0))

    def push(t: float, k: int, a: int, b: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, k, a, b))

    def add_busy(nd: SimNode, a: float, b: float) -> None:
        lo, hi = max(a, tw), min(b, te)
        if hi > lo:
            nd.busy += hi - lo

    def schedule_decode(nd: SimNode, now: float) -> None:
        nd.ver += 1
        if nd.decoding:
            push(now + (nd.decoding[0][0] - nd.vt) * nd.step(len(nd.decoding)), DECODE, nd.idx, nd.ver)

    def engine_store(nd: SimNode, units: list[int], now: float) -> None:
        assert nd.cache is not None
        stored, evicted = nd.cache.store(units)
        if indexes is not None and (stored or evicted):
            indexes.engine_event(nd.idx, nd.cache.bu * 16, stored * 16, evicted * 16, now, push)

    def start_prefill(nd: SimNode, now: float) -> None:
        nd.advance(now)
        if nd.prefq:
            r = nd.prefq.popleft()
            nd.prefq_tok -= U[r]
            if nd.cache is not None:  # the engine looks its cache up when it schedules the prefill
                cached[r] = nd.cache.cached_tokens(prompts[r].units, P[r])
                U[r] = P[r] - cached[r]
            nd.cur = r
            nd.cur_end = now + U[r] / nd.pf
            nd.ver += 1
            push(nd.cur_end, PREFILL, nd.idx, 0)
        else:
            schedule_decode(nd, now)

    def complete(nd: SimNode, r: int, now: float) -> None:
        nd.admitted -= 1
        nd.outstanding -= 1
        if tw <= now <= te:
            nd.done_in_window += 1
            nd.tokens_in_window += O[r]
        if nd.outstanding == 0:
            add_busy(nd, nd.busy_since, now)
        if nd.waitq:
            r2 = nd.waitq.popleft()
            nd.waitq_tok -= U[r2]
            nd.admitted += 1
            nd.prefq.append(r2)
            nd.prefq_tok += U[r2]
        if cache_wl:
            engine_store(nd, prompts.pop(r).units_out, now)  # the reply's blocks too
            chain = chains.pop(r, None)
            if indexes is not None and chain is not None:  # the engine's usage report
                indexes.correct(routers.rep_of[r], nd.idx, chain, cached[r], P[r], now, push)
        if R:
            routers.complete(r, now, push)
        if hidden == "learn" and streamed[r] and first_at[r]:
            c, ahead = seen_at[r]
            f0, f1, ri = fed_at[r]
            f2 = fed[ri][nd.idx]
            sample = SpeedSample(ttft_s=ttft[r], prefill_tokens=0.0 if math.isnan(ahead) else ahead + U[r],
                                 prefill_reported=True, inflight=c,
                                 decode_s=now - first_at[r], decode_tokens=O[r] - 1,
                                 alone=ahead == 0.0 and f1 == f0, joined_tokens=f1 - f0, decode_prefill_tokens=f2 - f1)
            book[nd.idx] = observe_sample(book[nd.idx], sample, now, nd.maxc)

    def arrive(nd: SimNode, r: int, now: float) -> None:
        nd.advance(now)
        if nd.cache is not None:  # expected prefill, for the queue (checked again at its start)
            U[r] = P[r] - nd.cache.cached_tokens(prompts[r].units, P[r])
        if nd.outstanding == 0:
            nd.busy_since = now
        nd.outstanding += 1
        if nd.admitted < nd.maxc:
            nd.admitted += 1
            nd.prefq.append(r)
            nd.prefq_tok += U[r]
        else:
            nd.waitq.append(r)
            nd.waitq_tok += U[r]
        if nd.cur < 0:
            start_prefill(nd, now)

    done = 0
    k = 0
    while done < n:
        next_arr = arr[k] if k < n else math.inf
        if heap and heap[0][0] < next_arr:
            now, _, ev, a, b = heapq.heappop(heap)
            if ev == EXPIRE:  # non-streamed a's estimated first token: no longer pending
                routers.expire(a, now, push)
                continue
            if ev == DELTA:  # a peer's in-flight delta reaches replica a
                routers.deliver(a, b)
                continue
            if ev == SHARE:  # a peer's (or an engine's) index update reaches replica a
                assert indexes is not None
                indexes.deliver(a, b, now)
                continue
            if ev == DRIFT:  # true speeds wander (hidden speeds)
                for nd in nodes:
                    nd.advance(now)
                    f = 1.0 + drift * math.sin(2 * math.pi * now / DRIFT_PERIOD_S + phases[nd.idx])
                    nd.pf, nd.dec = profs[nd.idx].prefill_tps * f, profs[nd.idx].decode_tps * f
                    if nd.cur < 0:
                        schedule_decode(nd, now)
                if hidden == "learn" and debug_err is not None:
                    for nd in nodes:
                        e = published(book[nd.idx], now)
                        debug_err[nd.idx].append((math.log(e.prefill_tps / nd.pf), math.log(e.decode_tps / nd.dec)))
                push(now + DRIFT_EVERY_S, DRIFT, 0, 0)
                continue
            nd = nodes[a] if ev != POLL else nodes[b]
            if ev == PREFILL:
                r = nd.cur
                nd.cur = -1
                nd.last_t = now
                ttft[r] = now - arr[r]
                first_at[r] = now
                if hidden == "learn":
                    f0, _f1, ri = fed_at[r]
                    fed_at[r] = (f0, fed[ri][nd.idx], ri)
                if nd.cache is not None:
                    engine_store(nd, prompts[r].units, now)
                if R:
                    routers.first_token(r, streamed[r], now, push)
                o = O[r] - 1
                if o > 0:
                    heapq.heappush(nd.decoding, (nd.vt + o, r))
                else:
                    complete(nd, r, now)
                    done += 1
                start_prefill(nd, now)
            elif ev == DECODE:
                if b != nd.ver:
                    continue
                nd.vt = nd.decoding[0][0]
                nd.last_t = now
                while nd.decoding and nd.decoding[0][0] <= nd.vt + EPS:
                    _, r = heapq.heappop(nd.decoding)
                    complete(nd, r, now)
                    done += 1
                start_prefill(nd, now)
            else:  # POLL by replica a of node b
                reps[a][0][b].state = told(nd, now)
                push(now + poll * rnd.uniform(0.8, 1.2), POLL, a, b)
            continue
        # arrival
        r = k
        k += 1
        now = arr[r]
        chain = None
        if builder is not None:
            pr = prompts[r] = builder.build(r)
            est_p[r] = prompt_tokens_from_body(len(pr.data) + pr.envelope)
            if indexes is not None:
                chain = chains[r] = chain_from_bytes(pr.data, mseed)
        if kind == "zml":
            ri = r % R
            views, fleet, rstate = reps[ri]
            if fresh:
                for nd in nodes:
                    views[nd.idx].state = told(nd, now)
            assert pol is not None
            cache = indexes.indexes[ri] if indexes is not None else None
            bound_to = sessions.get(prompts[r].session) if spec.get("session") and builder else None
            rr = RouteRequest(model=MODEL, prompt_tokens=est_p[r], prefix=chain, session_node=bound_to)
            try:  # the router's own decision: choose_node under the admission bound
                d = admit(fleet, rr, pol, now, rstate, stale_after_s=STALE_AFTER_S, ttft_bound_s=bound, cache=cache)
            except QueueFullError:
                rejected[r] = True
                done += 1
                prompts.pop(r, None)
                chains.pop(r, None)
                continue
            nd = nodes[_index[d.node_id]]
            if hidden == "learn":  # what the router knows at dispatch: in flight, prefill queued ahead
                v = views[nd.idx]
                # the prefill ahead, when known: nothing pending, or the pending requests' tokens
                # counted (a mean prompt per pending request is too rough to learn a speed from)
                ahead = v.pending_tokens if v.pending_tokens is not None else (0.0 if v.pending == 0 else math.nan)
                seen_at[r] = (v.outstanding + 1, ahead)
                fed[ri][nd.idx] += max(0, est_p[r] - d.cached_tokens)
                fed_at[r] = (fed[ri][nd.idx], 0.0, ri)
            routers.dispatch(r, ri, nd.idx, streamed[r], d.estimated_ttft_s, now, push,
                             tokens=max(0, est_p[r] - d.cached_tokens))
            if indexes is not None and chain is not None:
                indexes.record(ri, nd.idx, chain, now, push)
            if spec.get("session") and builder is not None and prompts[r].session >= 0:
                sessions[prompts[r].session] = nd.name
        elif kind == "least_busy":
            nd = min(nodes, key=lambda x: (x.outstanding, rnd.random()))
        elif kind == "p2c":
            a1, a2 = rnd.sample(nodes, 2)
            nd = a1 if (a1.outstanding, rnd.random()) < (a2.outstanding, rnd.random()) else a2
        else:  # oracle: the same admission bound, on the exact TTFT
            units = prompts[r].units if builder is not None else None
            nd, pred[r] = _oracle(nodes, now, r, P, U, O, bound, units, spec.get("sticky", False))
            if pred[r] > bound:
                rejected[r] = True
                done += 1
                prompts.pop(r, None)
                continue
        arrive(nd, r, now)

    if hidden == "learn" and os.environ.get("ROUTING_SIM_DEBUG"):  # what was learned vs the truth
        for nd in nodes:
            e = published(book[nd.idx], te)
            errs = debug_err[nd.idx] if debug_err else [(0.0, 0.0)]
            pe = float(np.mean([x for x, _ in errs])); pa = float(np.mean([abs(x) for x, _ in errs]))
            de = float(np.mean([y for _, y in errs])); da = float(np.mean([abs(y) for _, y in errs]))
            print(f"  log err prefill bias {pe:+.2f} abs {pa:.2f}; decode bias {de:+.2f} abs {da:.2f}", file=sys.stderr)
            print(f"{workload} {seed} {nd.name}: prefill {e.prefill_tps:.0f}/{nd.pf:.0f} decode {e.decode_tps:.1f}/"
                  f"{nd.dec:.1f} sigma {e.prefill_sigma:.2f}/{e.decode_sigma:.2f} n={e.samples}", file=sys.stderr)
    served_mask = ~np.array(rejected[warm:])
    meas = np.array(ttft[warm:])[served_mask]
    ok = ~np.isnan(np.array(pred)) & ~np.array(rejected)
    pred_err = float(np.max(np.abs(np.array(pred)[ok] - np.array(ttft)[ok]))) if kind == "oracle" and ok.any() else 0.0
    window = te - tw
    served = sum(nd.done_in_window for nd in nodes) / window
    tokens = sum(nd.tokens_in_window for nd in nodes)
    dollars = sum(nd.busy / 3600.0 * nd.cost for nd in nodes)
    util = [nd.done_in_window / window / nd.prof.capacity_rps(MEAN_P, MEAN_O) for nd in nodes]
    kept = np.flatnonzero(~np.array(rejected[warm:])) + warm
    inp = float(np.sum(np.array(P)[kept]))
    hit = float(np.sum(np.array(cached)[kept]))
    return {
        "policy": f"{policy}@{hidden}" if hidden else policy, "workload": workload, "load": load, "seed": seed, "n": n, "opts": o_,
        "p50": float(np.percentile(meas, 50)), "p90": float(np.percentile(meas, 90)),
        "p99": float(np.percentile(meas, 99)),
        "share": float(np.mean(meas <= TARGET_S)), "thr": served / cap,
        "offered": (n - 1 - warm) / window / cap,  # this trace's arrival rate in the window
        "offered_nocache": (n - 1 - warm) / window / cap_nocache,
        "rejected": float(np.mean(rejected[warm:])),
        "cost": dollars / (tokens / 1e6), "imb": max(util) / (sum(util) / len(util)), "pred_err": pred_err,
        # prompt tokens served, and of them found in the node's prefix cache (the truth)
        "input": inp, "cached": hit, "hit": hit / inp if inp else 0.0, "in_tps": inp / window,
    }


_index = {name: i for i, (name, _t) in enumerate(FLEET)}


def _oracle(nodes: list[SimNode], now: float, r: int, P: list[int], U: list[int], O: list[int],
            bound: float = math.inf, units: list[int] | None = None,
            sticky: bool = False) -> tuple[SimNode, float]:
    """The node with the smallest exact TTFT, and that TTFT (inf: every node is over ``bound``).

    With ``units`` (shared-prefix workloads) each node's own prefill of the request is its
    uncached part, read from the engine's cache (clairvoyant: no index, no lag). ``sticky``:
    the cache oracle, which applies the latency policy's sticky rule to the exact TTFTs and the
    true cached tokens (a warmer node wins while ``ttft_w - cached_w / pf_ref`` beats the
    fastest node's)."""
    def p_on(nd: SimNode) -> int:
        return U[r] if nd.cache is None or units is None else P[r] - nd.cache.cached_tokens(units, P[r])

    if sticky:
        scored = []
        for nd in nodes:
            p = p_on(nd)
            scored.append((nd.predict_ttft(now, p, U, O), P[r] - p, nd))
        ref_t, ref_c, ref = min(scored, key=lambda x: (x[0], x[2].idx))
        best, best_s, best_t = ref, ref_t - ref_c / ref.pf, ref_t
        for t, c, nd in scored:
            if c > ref_c and t - c / ref.pf < best_s:
                best, best_s, best_t = nd, t - c / ref.pf, t
        return best, best_t
    best, best_t = nodes[0], math.inf
    full = []
    for nd in nodes:
        if nd.admitted < nd.maxc:
            t = nd.predict_ttft(now, p_on(nd), U, O)
            if t < best_t:
                best, best_t = nd, t
        else:
            full.append(nd)
    full.sort(key=lambda x: x.lower_bound(now, p_on(x)))
    for nd in full:
        p = p_on(nd)
        if nd.lower_bound(now, p) >= best_t:
            break
        t = nd.predict_ttft(now, p, U, O, min(best_t, bound))
        if t < best_t:
            best, best_t = nd, t
    return best, best_t


# --- driver -----------------------------------------------------------------------------

def _task(args: tuple[str, str, float, int, int, int, dict[str, Any]]) -> dict[str, Any]:
    return run(*args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--warmup", type=int, default=None, help="discarded first requests (default 10%%, max 5000)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=1, help="seeds are first-seed .. first-seed+seeds-1")
    ap.add_argument("--stream-share", type=float, default=DEFAULT_OPTS["stream_share"],
                    help="share of streamed requests (the others stay pending until completion)")
    ap.add_argument("--estimate", choices=("body", "exact"), default=DEFAULT_OPTS["estimate"],
                    help="prompt length the policies see: the router's body-size estimate, or exact")
    ap.add_argument("--admission", type=float, default=DEFAULT_OPTS["admission_s"],
                    help="admission bound on estimated TTFT, s (0: none)")
    ap.add_argument("--pending-expiry", type=float, default=DEFAULT_OPTS["pending_expiry"],
                    help="a non-streamed request stops counting as pending after this many times its "
                         "estimated TTFT (0: at completion)")
    ap.add_argument("--load-basis", choices=("reuse", "nocache"), default=DEFAULT_OPTS["load_basis"],
                    help="shared-prefix workloads: offered load as a share of the fleet's capacity with perfect "
                         "prefix reuse, or with every prompt token prefilled (the capacity today's policy sees)")
    ap.add_argument("--hidden", default="", help="hidden true speeds (0.3-3x the type's, drifting): a comma list "
                    "of 'learn' (the router is told only the profile and learns) and 'told' (told the truth)")
    ap.add_argument("--drift", type=float, default=0.3, help="with --hidden: the true speeds wander +/- this share")
    ap.add_argument("--explore", default="", help="tuning: EXPLORE_Z,EXPLORE_CAP of zmlcore.policy.estimate")
    ap.add_argument("--loads", default="50,80,95,110")
    ap.add_argument("--workloads", default="poisson,bursty",
                    help="poisson,bursty (the reference workload) or chat,agent,rag,noshare,hot (shared prefixes)")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--append", action="store_true", help="with --save: add to the file's results (same key replaced)")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (e.g. docs/routing-sim.png)")
    ap.add_argument("--save", default=None, help="write the per-run results as JSON")
    ap.add_argument("--load-results", default=None,
                    help="report/plot saved results instead of simulating (several files: comma-separated)")
    ap.add_argument("--knee", action="store_true",
                    help=f"per policy and seed, run --loads in ascending order until p90 TTFT exceeds "
                         f"{KNEE_SLO_S:g} s; report input tokens/s at the last load within it")
    args = ap.parse_args(argv)
    if args.load_results:
        import json

        results = [r for f in args.load_results.split(",") for r in json.loads(Path(f).read_text())]
        pols = list(dict.fromkeys(r["policy"] for r in results))
        loads = sorted({r["load"] for r in results})
        workloads = list(dict.fromkeys(r["workload"] for r in results))
        plain = [r for r in results if r["workload"] not in CACHE_WORKLOADS]
        if plain:
            report(plain, pols, loads, [w for w in workloads if w not in CACHE_WORKLOADS])
            targets(plain)
        if len(plain) < len(results):
            cache_report(results)
        if any(r["workload"] in CACHE_WORKLOADS for r in results) and len({r["load"] for r in results}) > 2:
            knee_table([r for r in results if r["workload"] in CACHE_WORKLOADS])
        if args.plot:
            plot(results, pols, loads, workloads, args.plot)
        return
    n = args.requests
    warm = args.warmup if args.warmup is not None else min(5000, n // 10)
    if args.knee:
        knee_sweep(args, n, warm)
        return
    loads = [float(x) / 100 for x in args.loads.split(",")]
    pols = args.policies.split(",")
    opts = {"stream_share": args.stream_share, "estimate": args.estimate, "admission_s": args.admission,
            "pending_expiry": args.pending_expiry, "load_basis": args.load_basis}
    if args.explore:
        opts["explore"] = tuple(float(x) for x in args.explore.split(","))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    modes = [{**opts, "hidden": h, "drift": args.drift} for h in args.hidden.split(",")] if args.hidden else [opts]
    tasks = [(p, w, ld, s, n, warm, o) for w in args.workloads.split(",") for ld in loads for s in seeds
             for p in pols for o in modes]
    if args.hidden:
        pols = [f"{p}@{h}" for p in pols for h in args.hidden.split(",")]
    tasks.sort(key=lambda t: (t[0] != "oracle", -t[2]))  # longest first
    t0 = time.perf_counter()
    with Pool(args.jobs) as pool:
        results = pool.map(_task, tasks, chunksize=1)
    elapsed = time.perf_counter() - t0
    print(f"# routing_sim: {n} requests/run ({warm} warm-up), {args.seeds} seed(s), {len(tasks)} runs, "
          f"{elapsed:.0f} s on {args.jobs} process(es); capacity {capacity_rps():.2f} req/s\n")
    if args.save:
        import json

        old = json.loads(Path(args.save).read_text()) if args.append and Path(args.save).exists() else []
        key = lambda r: (r["policy"], r["workload"], r["load"], r["seed"])  # noqa: E731
        new = {key(r) for r in results}
        Path(args.save).write_text(json.dumps([r for r in old if key(r) not in new] + results))
    errs = [r["pred_err"] for r in results if r["policy"] == "oracle"]
    if errs:
        print(f"oracle: largest |predicted - realised TTFT| = {max(errs):.1e} s\n")
    plain = [r for r in results if r["workload"] not in CACHE_WORKLOADS]
    if plain:
        report(plain, pols, loads, [w for w in args.workloads.split(",") if w not in CACHE_WORKLOADS])
        targets(plain)
    if len(plain) < len(results):
        cache_report(results)
    if args.plot:
        plot(results, pols, loads, args.workloads.split(","), args.plot)


#: The TTFT SLO of the knee: the highest load at which p90 TTFT stays within it.
KNEE_SLO_S = 1.0


def cache_report(results: list[dict[str, Any]]) -> None:
    """Shared-prefix workloads: per workload and load, each policy's TTFT and cached share;
    then the issue's targets, per seed."""
    rs = [r for r in results if r["workload"] in CACHE_WORKLOADS]
    by = {(r["policy"], r["workload"], r["load"], r["seed"]): r for r in rs}
    seeds = sorted({r["seed"] for r in rs})
    for w in dict.fromkeys(r["workload"] for r in rs):
        for ld in sorted({r["load"] for r in rs if r["workload"] == w}):
            pols = list(dict.fromkeys(r["policy"] for r in rs if r["workload"] == w and r["load"] == ld))
            print(f"\n### {w}, {int(round(ld * 100))}% load: TTFT p50 / p90 / p99 (s), prompt tokens found cached, "
                  f"input tokens/s, throughput / capacity (mean of seeds {', '.join(map(str, seeds))})\n")
            print("| policy | p50 | p90 | p99 | cached | input tok/s | throughput |")
            print("|---|---|---|---|---|---|---|")
            for p in pols:
                xs = [by[(p, w, ld, s)] for s in seeds if (p, w, ld, s) in by]
                print(f"| {p} | {_m(xs, 'p50'):.3f} | {_m(xs, 'p90'):.3f} | {_m(xs, 'p99'):.3f} | "
                      f"{100 * _m(xs, 'hit'):.1f}% | {_m(xs, 'in_tps'):,.0f} | {_m(xs, 'thr'):.3f} |")
    rows: list[tuple[str, list[float] | None, str]] = []

    def per_seed(f: Any) -> list[float] | None:
        try:
            return [f(s) for s in seeds]
        except KeyError:
            return None

    def get(p: str, w: str, ld: float, s: int, k: str) -> float:
        return float(by[(p, w, ld, s)][k])

    for w in ("chat", "agent"):
        rows.append((f"{w} 80%: p90 latency / p90 cache", per_seed(lambda s: get("latency", w, 0.8, s, "p90")
                                                                     / get("cache", w, 0.8, s, "p90")), ">= 5"))
        rows.append((f"{w} 80%: p90 round_robin / p90 cache", per_seed(
            lambda s: get("round_robin", w, 0.8, s, "p90") / get("cache", w, 0.8, s, "p90")), ">= 10"))
        rows.append((f"{w} 80%: cached tokens, cache / oracle_cache", per_seed(
            lambda s: get("cache", w, 0.8, s, "cached") / get("oracle_cache", w, 0.8, s, "cached")), ">= 0.90"))
        rows.append((f"{w} 80%: hit rate, 4 replicas (1-5 ms lag) - one router (points)", per_seed(
            lambda s: 100 * (get("cache_r4_lag1_5", w, 0.8, s, "hit") - get("cache", w, 0.8, s, "hit"))), ">= -5"))
    rows.append(("noshare 80%: p99 cache / p99 latency", per_seed(
        lambda s: get("cache", "noshare", 0.8, s, "p99") / get("latency", "noshare", 0.8, s, "p99")), "<= 1.03"))
    rows.append(("hot 50%: p99 cache / p99 latency", per_seed(
        lambda s: get("cache", "hot", 0.5, s, "p99") / get("latency", "hot", 0.5, s, "p99")), "<= 1.03"))
    print(f"\n### targets, per seed ({', '.join(map(str, seeds))})\n")
    print("| measure | per seed | target |")
    print("|---|---|---|")
    for name, vals, tgt in rows:
        if vals is not None:
            print(f"| {name} | {' / '.join(f'{v:.3f}' for v in vals)} | {tgt} |")


def knee_sweep(args: Any, n: int, warm: int) -> None:
    """The knee of each (workload, policy, seed): loads in ascending order until one's p90 TTFT
    exceeds KNEE_SLO_S (later loads would only be over it too)."""
    import json

    loads = sorted(float(x) / 100 for x in args.loads.split(","))
    opts = {"stream_share": args.stream_share, "estimate": args.estimate, "admission_s": args.admission,
            "pending_expiry": args.pending_expiry, "load_basis": args.load_basis}
    if args.explore:
        opts["explore"] = tuple(float(x) for x in args.explore.split(","))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for w in args.workloads.split(","):
        for p in args.policies.split(","):
            for s in seeds:
                for ld in loads:
                    r = run(p, w, ld, s, n, warm, opts)
                    results.append(r)
                    print(f"{w} {p} seed {s} load {ld:.2f}: p90 {r['p90']:.3f} s, {r['in_tps']:,.0f} input tok/s",
                          flush=True)
                    if r["p90"] > KNEE_SLO_S:
                        break
    if args.save:
        Path(args.save).write_text(json.dumps(results))
    print(f"\n# knee sweep: {n} requests/run, {time.perf_counter() - t0:.0f} s\n")
    knee_table(results)


def knee_table(rs: list[dict[str, Any]]) -> None:
    seeds = sorted({r["seed"] for r in rs})
    print(f"| workload | policy | knee load (per seed) | input tok/s at the knee (per seed) |")
    print("|---|---|---|---|")
    for w in dict.fromkeys(r["workload"] for r in rs):
        for p in dict.fromkeys(r["policy"] for r in rs if r["workload"] == w):
            ks = [knee(rs, w, p, s) for s in seeds]
            print(f"| {w} | {p} | " + " / ".join("-" if k is None else f"{k[0]:.2f}" for k in ks) + " | "
                  + " / ".join("-" if k is None else f"{k[1]:,.0f}" for k in ks) + " |")
    for w in dict.fromkeys(r["workload"] for r in rs):
        for base in ("round_robin", "latency"):
            v = knee_ratio(rs, w, "cache", base, seeds)
            if v:
                print(f"\n{w}: input tok/s at the knee, cache / {base}: " + " / ".join(f"{x:.2f}" for x in v))


def knee(rs: list[dict[str, Any]], w: str, p: str, s: int) -> tuple[float, float] | None:
    """(load, input tokens/s) of the highest load of the sweep whose p90 TTFT is within
    KNEE_SLO_S (every lower load within it too); None if no load of the sweep is."""
    pts = sorted((r["load"], r) for r in rs if r["workload"] == w and r["policy"] == p and r["seed"] == s)
    best = None
    for ld, r in pts:
        if r["p90"] > KNEE_SLO_S:
            break
        best = (ld, r["in_tps"])
    return best


def knee_ratio(rs: list[dict[str, Any]], w: str, p: str, base: str, seeds: list[int]) -> list[float] | None:
    out = []
    for s in seeds:
        a, b = knee(rs, w, p, s), knee(rs, w, base, s)
        if a is None or b is None:
            return None
        out.append(a[1] / b[1])
    return out


def report(results: list[dict[str, Any]], pols: list[str], loads: list[float], workloads: list[str]) -> None:
    by = {(r["policy"], r["workload"], r["load"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    for w in workloads:
        print(f"\n### {w}: p99 TTFT (s) / x oracle p99 (same trace) / share <= 500 ms / p50 (s)\n")
        print("| policy | " + " | ".join(f"{int(ld*100)}%" for ld in loads) + " |")
        print("|---|" + "---|" * len(loads))
        for p in pols:
            cells = []
            for ld in loads:
                rs = [by[(p, w, ld, s)] for s in seeds if (p, w, ld, s) in by]
                if not rs:
                    cells.append("-")
                    continue
                ratio = [by[(p, w, ld, s)]["p99"] / by[("oracle", w, ld, s)]["p99"] for s in seeds
                         if ("oracle", w, ld, s) in by and (p, w, ld, s) in by]
                rt = f" / {np.mean(ratio):.2f}x" if ratio else ""
                if len(ratio) > 1:
                    rt += f" [{min(ratio):.2f}-{max(ratio):.2f}]"
                cells.append(f"{_m(rs, 'p99'):.2f}{rt} / {100*_m(rs, 'share'):.1f}% / {_m(rs, 'p50'):.2f}")
            print(f"| {p} | " + " | ".join(cells) + " |")
        print(f"\n### {w}: throughput / capacity, rejected by admission, $ per 1M output tokens (busy-time billing), "
              "imbalance (max/mean utilisation)\n")
        print("| policy | " + " | ".join(f"{int(ld*100)}%" for ld in loads) + " |")
        print("|---|" + "---|" * len(loads))
        for p in pols:
            cells = []
            for ld in loads:
                rs = [by[(p, w, ld, s)] for s in seeds if (p, w, ld, s) in by]
                cells.append(f"{_m(rs, 'thr'):.3f} / {100*_m(rs, 'rejected'):.1f}% / ${_m(rs, 'cost'):.3f} / "
                             f"{_m(rs, 'imb'):.2f}" if rs else "-")
            print(f"| {p} | " + " | ".join(cells) + " |")


def targets(results: list[dict[str, Any]]) -> None:
    """The issue's targets, per seed (Poisson unless said): what the tables average."""
    by = {(r["policy"], r["workload"], r["load"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})

    def per_seed(f: Any) -> list[float] | None:
        try:
            return [f(s) for s in seeds]
        except KeyError:
            return None

    def p99(p: str, ld: float, s: int, w: str = "poisson") -> float:
        return float(by[(p, w, ld, s)]["p99"])

    rows: list[tuple[str, Any, str]] = []
    for w in ("poisson", "bursty"):
        at = "" if w == "poisson" else f"{w} "
        for ld, lim in ((0.5, 1.05), (0.8, 1.10), (0.95, 1.05)):
            rows.append((f"latency p99 / oracle p99, {at}{int(ld*100)}%",
                         per_seed(lambda s: p99("latency", ld, s, w) / p99("oracle", ld, s, w)), f"<= {lim:.2f}"))
        for ld in (0.8, 0.95):
            rows.append((f"least_busy p99 / latency p99, {at}{int(ld*100)}%",
                         per_seed(lambda s: p99("least_busy", ld, s, w) / p99("latency", ld, s, w)), ">= 5"))
    for w in ("poisson", "bursty"):
        rows.append((f"latency throughput / capacity, {w} 110%", per_seed(lambda s: by[("latency", w, 1.1, s)]["thr"]),
                     ">= 0.99"))
        rows.append((f"  rejected by admission, {w} 110%", per_seed(lambda s: by[("latency", w, 1.1, s)]["rejected"]), ""))
    for lag in ("lag1_5", "lag10_50"):
        for ld in (0.5, 0.8, 0.95):
            rows.append((f"4 replicas {lag} p99 / one router, {int(ld*100)}%",
                         per_seed(lambda s: p99(f"latency_r4_{lag}", ld, s) / p99("latency", ld, s)),
                         "<= 1.2" if lag == "lag1_5" else ""))
    for ld in (0.5, 0.8):
        rows.append((f"cost $/1M tok vs latency, {int(ld*100)}%",
                     per_seed(lambda s: by[("cost", "poisson", ld, s)]["cost"] / by[("latency", "poisson", ld, s)]["cost"] - 1),
                     "<= -0.04"))
        rows.append((f"  share <= 500 ms lost (pt), {int(ld*100)}%",
                     per_seed(lambda s: 100 * (by[("latency", "poisson", ld, s)]["share"] - by[("cost", "poisson", ld, s)]["share"])),
                     "<= 0.5"))
    print(f"\n### targets, per seed ({', '.join(map(str, seeds))})\n")
    print("| measure | per seed | target |")
    print("|---|---|---|")
    for name, vals, tgt in rows:
        if vals is not None:
            print(f"| {name} | {' / '.join(f'{v:.3f}' for v in vals)} | {tgt} |")


def _m(rs: list[dict[str, Any]], k: str) -> float:
    return float(np.mean([r.get(k, 0.0) for r in rs]))


def plot(results: list[dict[str, Any]], pols: list[str], loads: list[float], workloads: list[str], path: str) -> None:
    """The reference workloads (p99 / oracle, cost) and, when the results hold them, the
    shared-prefix workloads (p90 TTFT and cached share against load) in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cached = [r for r in results if r["workload"] in CACHE_WORKLOADS]
    results = [r for r in results if r["workload"] not in CACHE_WORKLOADS]
    workloads = [w for w in workloads if w not in CACHE_WORKLOADS] or ["poisson"]
    pols = [p for p in pols if any(r["policy"] == p for r in results)] or pols
    agg: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    cost: dict[tuple[str, str, float], list[float]] = defaultdict(list)
    oracle = {(r["workload"], r["load"], r["seed"]): r["p99"] for r in results if r["policy"] == "oracle"}
    for r in results:
        o = oracle.get((r["workload"], r["load"], r["seed"]))
        if o:
            agg[(r["policy"], r["workload"], r["load"])].append(r["p99"] / o)
        cost[(r["policy"], r["workload"], r["load"])].append(r["cost"])
    cmap = plt.get_cmap("tab20")
    colour = {p: cmap(i % 20) for i, p in enumerate(pols)}
    cwl = list(dict.fromkeys(r["workload"] for r in cached))
    rows = 2 + (2 if cached else 0)
    cols = max(len(workloads), len(cwl))
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    loads = sorted({r["load"] for r in results}) or loads
    x = [ld * 100 for ld in loads]
    for j, w in enumerate(workloads):
        ax = axes[0][j]
        for p in pols:
            ys = [np.mean(agg[(p, w, ld)]) if agg[(p, w, ld)] else np.nan for ld in loads]
            ax.plot(x, ys, marker="o", label=p, color=colour[p], lw=2.5 if p in ("oracle", "latency") else 1.2,
                    ls="--" if p.startswith("latency_") else "-")
        ax.set_yscale("log")
        ax.set_title(f"{w}: p99 TTFT / oracle p99 (same trace)")
        ax.set_xlabel("offered load (% of capacity)")
        ax.set_ylabel("p99 TTFT ratio to the greedy oracle")
        ax.axhline(1.1, color="grey", lw=0.8, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        ax = axes[1][j]
        for p in pols:
            if p in ("round_robin",) or p.startswith("latency_"):
                continue
            ys = [np.mean(cost[(p, w, ld)]) if cost[(p, w, ld)] else np.nan for ld in loads]
            ax.plot(x, ys, marker="o", label=p, color=colour[p])
        ax.set_title(f"{w}: $ per 1M output tokens (busy-time billing)")
        ax.set_xlabel("offered load (% of capacity)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    axes[1][0].legend(fontsize=7, ncol=2)
    if cached:
        style = {"cache": ("tab:green", 2.5), "latency": ("tab:blue", 2.0), "round_robin": ("tab:red", 1.5),
                 "oracle_cache": ("black", 1.2)}
        for j, w in enumerate(cwl):
            for row, key, title in ((2, "p90", "p90 TTFT (s)"), (3, "hit", "prompt tokens found cached")):
                ax = axes[row][j]
                for p in dict.fromkeys(r["policy"] for r in cached if r["workload"] == w):
                    pts: dict[float, list[float]] = defaultdict(list)
                    for r in cached:
                        if r["workload"] == w and r["policy"] == p:
                            pts[r["load"]].append(r[key])
                    xs = sorted(pts)
                    c, lw = style.get(p, (None, 1.0))
                    ax.plot([v * 100 for v in xs], [float(np.median(pts[v])) for v in xs], marker="o", label=p,
                            color=c, lw=lw)
                if key == "p90":
                    ax.set_yscale("log")
                    ax.axhline(KNEE_SLO_S, color="grey", lw=0.8, ls=":")
                ax.set_title(f"{w} (shared prefixes): {title}, median of seeds")
                ax.set_xlabel("offered load (% of the capacity with perfect prefix reuse)")
                ax.grid(True, which="both", alpha=0.3)
            axes[2][j].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
