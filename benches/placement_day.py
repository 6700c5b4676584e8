"""A day of demand, request by request: the placement planner against today's static
placement, one family only, and a hindsight optimum, routed by the router's own decision and
moved by the planner's own steps (issue 32 item 5).

What runs is ZML's code: every request is routed by ``zmlcore.policy.admission.admit`` (the
router's ``choose_node`` under its admission bound, the "latency" policy) over ``NodeView``s of
the ``NodeState``s health would publish (polled every 5 s, with the router's own in-flight
counters between polls); every plan is ``zmlcore.placement.plan`` (HiGHS) on the offers
``slo_capacity`` gives; every move is a step of ``zmlcore.placement.moves.next_steps`` asked
again each second, make before break (an unload drains first: the node leaves the model's
routable set and unloads once its requests are done), the loads of models short of capacity
first (``placer.short_models``, as warmup passes them); an adapter request that finds its adapter
nowhere is refused (MODEL_NOT_LOADED, an SLO miss) and loads it where warmup's own
``placer.adapter_home`` says. Nodes are the routing simulator's engines
(benches/routing_simnode.py: FIFO prefill at the type's prefill speed, batched decode slowing 2%
per extra sequence, at most ``max_concurrency`` sequences), at each model's speed factor.

The day: 48 windows of 30 min; 20 models of three sizes (speed x1 / x0.5 / x0.25 of the type's,
16 / 32 / 70 GiB), each with its own mean prompt (256-4,096) and output (64-512) tokens (each
request lognormal around them, sigma 0.5), a TTFT target of 2 s; diurnal demand peaking at each
model's own hour, six 2-hour bursts of x2.5, 30% of each model's requests on 100 LoRA adapters
(Zipf). Fleet: the demo fleet's mix (sdk/src/zml/data/demo.toml: 2 H100 : 1 A100 : 2 MI300X :
1 Gaudi2 : 1 Inferentia2) times ``--scale``; one model per node at a time (vLLM, or llama.cpp
with --models-max 1), 8 adapter slots.

Time is sampled per window, not simulated whole (a day is millions of requests): a window's
rate is constant, so each window is simulated from 30 s before its start (the old placement,
the new rate: not measured) through its moves (until every planned replica serves and every
dropped one is unloaded) and then ``--steady`` seconds more. Its requests, cost and tokens are
the moving part as simulated plus the steady part scaled to the rest of the 30 minutes
(stratified sampling). Arrivals are Poisson at the window's rate.

Strategies (each on the same windows, the same arrival stream per window):
* ``static``: today's zml.toml: every node on all day, split among models by peak demand, each
  adapter loaded where its base runs (place_adapters on the day's demand), nothing moves;
* ``planner``: at each window's start the planner plans on the last window's measured demand
  (what its demand window saw), and again at each of ``--replans`` (600 s: the window's own
  rate), and the moves run while requests flow. The rates it is given are what warmup's demand
  window would measure (Poisson counts, ``Measured``; ``--true-rates``: the exact rates, as
  rounds 1-3), looked ahead by ``zmlcore.placement.forecast`` as warmup does ([planner]
  forecast_horizon_s / trend_s / forecast_spread: ``--horizon``, ``--trend``, ``--spread``);
* ``cheapest_family`` / ``fastest_family``: the same planner on one family's nodes only;
* ``hindsight``: the plan of each window's own demand, in place for the whole window (no move,
  no load time): the offline optimum the issue compares against.

    python benches/placement_day.py --scale 8 --steady 45 --seeds 21 22 --json benches/placement_day_56.json
    python benches/placement_day.py --scale 143 --seeds 21 22 --fluid --json benches/placement_day_1001_fluid.json

Seeds: LOAD, HEADROOM and --steady were chosen on seeds 11 and 5 only, the look-ahead on 11
and 12; 21 and 22 are reported (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_simnode import EPS, SimNode  # noqa: E402

from zmlcore.config import RouterConfig, parse_config  # noqa: E402
from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError, QueueFullError  # noqa: E402
from zmlcore.fleet.accelerators import ACCELERATORS, BASE_PREFILL_TPS  # noqa: E402
from zmlcore.fleet.perfmodel import SimProfile  # noqa: E402
from zmlcore.messages import NodeState  # noqa: E402
from zmlcore.placement import AdapterDemand, ModelDemand, NodeOffer, PlanParams, plan, slo_capacity  # noqa: E402
from zmlcore.placement.adapters import place_adapters  # noqa: E402
from zmlcore.placement.forecast import Lookahead, ahead  # noqa: E402
from zmlcore.placement.moves import NodeNow, next_steps  # noqa: E402
from zmlcore.policy import NodeView, RouteRequest, RoutingState, builtin_policy  # noqa: E402
from zmlcore.policy.admission import admit  # noqa: E402
from zml_warmup.placer import Inputs, adapter_home, demand_rates as placer_rates, short_models  # noqa: E402

DEMO_MIX = [("nvidia_h100", 2), ("nvidia_a100", 1), ("amd_mi300x", 2), ("intel_gaudi2", 1), ("aws_inferentia2", 1)]
SIZES = [(1.0, 16.0), (0.5, 32.0), (0.25, 70.0)]
N_MODELS, N_ADAPTERS, ADAPTER_SHARE = 20, 100, 0.3
TTFT_S = 2.0
#: Spread of a model's prompts (lognormal sigma around its mean) and outputs.
PROMPT_SIGMA, OUTPUT_SIGMA = 0.35, 0.5
#: A lognormal's mean over its median (the model's nominal size): what the planner is given as
#: the model's mean prompt and output, as its demand window measures them from completions.
#: (Given the medians, it planned 6% / 13% less work per request than came.)
PROMPT_MEAN, OUTPUT_MEAN = math.exp(PROMPT_SIGMA ** 2 / 2), math.exp(OUTPUT_SIGMA ** 2 / 2)
#: Share of saturation planned as SLO capacity ([planner] headroom).
HEADROOM = 0.8
#: The static split's own rule (an operator's, not the planner's): a node counts for 80% of its
#: saturation throughput.
STATIC_HEADROOM = 0.8
#: [planner] ttft_miss_share.
MISS_SHARE = 0.01
#: The sum of the models' peaks as a share of the fleet's saturation capacity for the mean model.
LOAD = 0.3
WINDOW_S = 1800.0
WARM_S = 30.0
POLL_S = 5.0
SWEEP_S = 1.0
ADAPTER_SLOTS = 8
ADAPTER_LOAD_S = 2.0
#: The nodes' engines load an adapter a request names (vLLM with a LoRA resolver: zml.toml
#: ``adapters_on_request``): the router may send an adapter's request to a node without it, its
#: estimate costing ADAPTER_LOAD_S. False (--no-adapters-on-request): such a request is refused
#: and warmup loads the adapter on demand, as for engines without a resolver.
ON_REQUEST = True
#: moves.next_steps is given each node's SLO capacity and each model's demand, as warmup gives
#: it: an urgent load does not wait for another model's moves (an early unload where that model
#: keeps capacity for its demand, a stand-in on an idle node meanwhile); False (--no-stand-ins):
#: round 2's executor.
EARLY = True
MAX_LOADS = 8
#: Seconds into a window when the planner's demand window (window_s = 600) shows only its rate.
REPLAN_S = 600.0
#: The plans simulated in each window, seconds into it (--replans): at its start (on the last
#: window's rate) and at REPLAN_S (on its own) by default. Warmup plans every 60 s; a plan
#: between them sees the demand window's mean part-way up a step (and its trend the ramp).
REPLANS: list[float] = [0.0, REPLAN_S]
#: The longest a window's moves are simulated (a plan still moving then is scored as it stands).
MOVES_CAP_S = 900.0
#: The steady sample starts once no request waits for a slot (see simulate_window); False
#: (--no-backlog-wait): at the last move, as round 2 sampled.
WAIT_BACKLOG = True
#: The planner is given the rates its demand window measures (requests counted over the last
#: ``DEMAND_WINDOW_S``, Poisson around the true rate, sampled every ``PLAN_EVERY_S`` as warmup
#: plans) and looks ahead on them (``zmlcore.placement.forecast``: [planner]
#: forecast_horizon_s, trend_s, forecast_spread). False (--true-rates): round 3's input, each
#: window's true rate.
ESTIMATED = True
LOOKAHEAD = Lookahead()
DEMAND_WINDOW_S = 600.0
PLAN_EVERY_S = 60.0
POLICY = builtin_policy("latency")
#: The router's clock at a window's start (a window's own times start 30 s before it, at -30 s;
#: the router reads 0 as "never").
CLOCK0 = 1e6
STALE = RouterConfig().stale_after_s
BOUND = RouterConfig().admission_ttft_s

ARR, PREFILL, DECODE, POLL, SWEEP, LOADED, AD_LOADED = range(7)
#: model -> [asked, within SLO] when set (a look inside while choosing parameters)
DEBUG: dict[str, list[int]] | None = None


@dataclass(frozen=True)
class Model:
    name: str
    speed: float
    memory: float
    prompt: float
    output: float
    peak: float
    peak_hour: float

    @property
    def ttft_s(self) -> float:
        """The model's TTFT target: 2 s, or 3x the fastest type's prefill of its mean prompt
        where that is more (an operator does not ask a 70B model for a 4k prompt in 2 s)."""
        return max(TTFT_S, 3.0 * self.prompt / (BASE_PREFILL_TPS * self.speed))


def fleet(scale: int) -> list[tuple[str, str]]:
    out = []
    for acc, k in DEMO_MIX:
        for i in range(k * scale):
            out.append((f"{ACCELERATORS[acc].family.lower()}-{i:03d}", acc))
    return out


def engine(acc: str, m: Model) -> tuple[float, float, int, float]:
    """(prefill tokens/s, decode tokens/s, max concurrency, batch penalty) of ``acc`` running ``m``."""
    a = ACCELERATORS[acc]
    return a.default_prefill_tps * m.speed, a.default_decode_tps * m.speed, a.max_concurrency, a.default_batch_penalty


def capacity(acc: str, m: Model, headroom: float, miss_share: float | None = None, means: bool = True) -> float:
    """Requests/s within the TTFT target: the planner's own slo_capacity, as placer.offers calls
    it ([planner] headroom and ttft_miss_share; ``miss_share`` 0: headroom alone), for the
    requests' mean sizes (``means`` False: the medians, as the day's load was first scaled)."""
    a = ACCELERATORS[acc]
    if m.memory > a.memory_gib:
        return 0.0
    pf, dec, maxc, pen = engine(acc, m)
    return slo_capacity(prefill_tps=pf, decode_tps=dec, max_concurrency=maxc, mean_prompt=m.prompt * (PROMPT_MEAN if means else 1.0),
                        mean_output=m.output * (OUTPUT_MEAN if means else 1.0), ttft_s=m.ttft_s, headroom=headroom, batch_penalty=pen,
                        miss_share=MISS_SHARE if miss_share is None else miss_share)


def load_time(acc: str, m: Model) -> float:
    """The type's load time for a 16 GiB model, in proportion to the weights."""
    return ACCELERATORS[acc].load_time_s * m.memory / 16.0


def workload(seed: int, nodes: list[tuple[str, str]], n_windows: int, load: float, n_models: int = N_MODELS,
             n_adapters: int = N_ADAPTERS):
    rng = random.Random(seed)
    models = []
    for i in range(n_models):
        speed, mem = SIZES[i % 3]
        models.append(Model(f"model-{i:02d}", speed, mem, prompt=rng.choice([256, 512, 1024, 2048, 4096]),
                            output=rng.choice([64, 128, 256, 512]), peak=rng.lognormvariate(0.0, 0.6),
                            peak_hour=rng.uniform(0, 24)))
    # (on the medians: the same day as before the planner was given the means)
    total_cap = sum(sum(capacity(acc, m, 1.0, 0.0, means=False) for _, acc in nodes) for m in models) / len(models)
    scale = load * total_cap / sum(m.peak for m in models)
    models = [Model(m.name, m.speed, m.memory, m.prompt, m.output, m.peak * scale, m.peak_hour) for m in models]
    bursts = {(rng.randrange(n_models), rng.randrange(n_windows)) for _ in range(6)}
    span = max(1, round(n_windows / 24))  # a burst lasts 2 hours: 4 windows of 30 min
    demand = []
    for w in range(n_windows):
        hour = w * 24 / n_windows
        row = {}
        for i, m in enumerate(models):
            diurnal = 0.25 + 0.75 * (1 + math.cos(2 * math.pi * (hour - m.peak_hour) / 24)) / 2
            burst = 2.5 if any((i, b) in bursts for b in range(w - 2 * span + 1, w + 1)) else 1.0
            row[m.name] = m.peak * diurnal * burst * rng.uniform(0.9, 1.1)
        demand.append(row)
    zipf = [1 / (k + 1) for k in range(n_adapters)]
    adapters = [(f"adapter-{k:03d}", models[k % n_models].name, zipf[k]) for k in range(n_adapters)]
    return models, demand, adapters


def plan_time(n_nodes: int = 1000, n_models: int = 50, n_adapters: int = 500, runs: int = 5,
              seed: int = 3) -> list[float]:
    """CPU seconds of one plan (zmlcore.placement.plan) for ``n_nodes`` of the demo mix, from a
    placement planned for the previous window's demand (the planner's steady case), at the
    busiest window of a day of ``n_models`` and ``n_adapters``."""
    per = sum(k for _, k in DEMO_MIX)
    nodes = fleet(-(-n_nodes // per))[:n_nodes]
    models, demand, adapters = workload(seed, nodes, 48, LOAD, n_models, n_adapters)
    w = max(range(1, 48), key=lambda i: sum(demand[i].values()))
    base, ads = split(adapters, demand[w - 1])
    prev = plan(offers(nodes, models, {}, {}, None, HEADROOM), [ModelDemand(m, r) for m, r in base.items()], ads)
    held = {n: ms for n, ms in prev.models.items() if ms}
    held_ad = {n: a for n, a in prev.adapters.items() if a}
    base, ads = split(adapters, demand[w])
    out = []
    for _ in range(runs):
        t0 = time.process_time()
        plan(offers(nodes, models, held, held_ad, None, HEADROOM), [ModelDemand(m, r) for m, r in base.items()], ads)
        out.append(time.process_time() - t0)
    return out


def split(adapters, row: dict[str, float]) -> tuple[dict[str, float], list[AdapterDemand]]:
    """A window's rates: each model's own requests, and its adapters' (Zipf shares of 30%)."""
    per_base: dict[str, float] = {}
    for _, b, z in adapters:
        per_base[b] = per_base.get(b, 0.0) + z
    base = {m: r * (1 - ADAPTER_SHARE) for m, r in row.items()}
    return base, [AdapterDemand(a, b, row[b] * ADAPTER_SHARE * z / per_base[b]) for a, b, z in adapters]


class Measured:
    """What warmup's demand window shows of each requested name (a model's own requests, each
    adapter's) at any plan time: requests counted per ``PLAN_EVERY_S`` bucket (Poisson at the
    window's true rate; before the day, the first window's), the last ``DEMAND_WINDOW_S`` of
    them over its length. Its own random stream: the same for every strategy."""

    def __init__(self, seed: int, demand: list[dict[str, float]], adapters, trend_s: float) -> None:
        import numpy as np
        self.per_window = WINDOW_S / PLAN_EVERY_S
        self.k = int(DEMAND_WINDOW_S / PLAN_EVERY_S)
        self.pre = int((trend_s + DEMAND_WINDOW_S) / PLAN_EVERY_S) + 1
        rows = [dict(zip(*self._names(split(adapters, r)))) for r in demand]
        self.names = list(rows[0])
        rate = np.array([[row[n] for n in self.names] for row in rows])  # window x name
        per_bucket = np.repeat(rate, int(self.per_window), axis=0)
        per_bucket = np.vstack([np.repeat(rate[:1], self.pre, axis=0), per_bucket])
        counts = np.random.default_rng(seed * 7919 + 13).poisson(per_bucket * PLAN_EVERY_S)
        self.cum = np.vstack([np.zeros((1, len(self.names))), np.cumsum(counts, axis=0)])

    @staticmethod
    def _names(parts: tuple[dict[str, float], list[AdapterDemand]]) -> tuple[list[str], list[float]]:
        base, ads = parts
        return [*base, *(a.adapter for a in ads)], [*base.values(), *(a.rate for a in ads)]

    def at(self, t: float) -> dict[str, float]:
        """The measured rates at day time ``t`` (seconds; a multiple of PLAN_EVERY_S)."""
        b = self.pre + int(round(t / PLAN_EVERY_S))
        got = (self.cum[b] - self.cum[b - self.k]) / DEMAND_WINDOW_S
        return dict(zip(self.names, got.tolist()))

    def planned(self, t: float, la: Lookahead) -> dict[str, float]:
        """What the planner provides for at ``t``: each name's measured rate, looked ahead on
        the rates measured at each plan of the last ``trend_s`` (zmlcore.placement.forecast)."""
        now = self.at(t)
        if la.off:
            return now
        n_back = int(la.trend_s / PLAN_EVERY_S)
        hist = [self.at(t - PLAN_EVERY_S * i) for i in range(n_back, 0, -1)] + [now]
        return {name: ahead([(t - PLAN_EVERY_S * (n_back - j), h[name]) for j, h in enumerate(hist)], la)
                for name in self.names}


def as_demands(adapters, rates: dict[str, float]) -> tuple[dict[str, float], list[AdapterDemand]]:
    """Measured rates by name as the planner's inputs: models' own, and adapters' on their base."""
    ads = [AdapterDemand(a, b, rates.get(a, 0.0)) for a, b, _ in adapters]
    names = {a for a, _, _ in adapters}
    return {n: r for n, r in rates.items() if n not in names}, ads


def offers(nodes, models, held, held_ad, families, headroom: float) -> list[NodeOffer]:
    out = []
    for nid, acc in nodes:
        a = ACCELERATORS[acc]
        if families is not None and a.family not in families:
            continue
        caps = {m.name: capacity(acc, m, headroom) for m in models}
        out.append(NodeOffer(nid, a.family, a.cost_per_hour, {k: v for k, v in caps.items() if v > 0},
                             adapter_slots=ADAPTER_SLOTS, models=held.get(nid, frozenset()),
                             adapters=held_ad.get(nid, frozenset())))
    return out


def static_placement(nodes, models, peak: dict[str, float]) -> dict[str, frozenset[str]]:
    """Every node on, split among the models by peak demand (zml.toml as an operator writes it)."""
    placed: dict[str, frozenset[str]] = {}
    need = {m.name: peak[m.name] for m in models}
    by_model = {m.name: m for m in models}
    for nid, acc in sorted(nodes, key=lambda n: (-ACCELERATORS[n[1]].memory_gib, n[0])):
        best = max((m for m in need if capacity(acc, by_model[m], 1.0, 0.0) > 0), key=lambda m: need[m],
                   default=None)
        if best is None:
            continue
        placed[nid] = frozenset({best})
        need[best] -= capacity(acc, by_model[best], STATIC_HEADROOM, 0.0)
    return placed


# --- one window, request by request ----------------------------------------------------------
@dataclass
class Node:
    idx: int
    nid: str
    acc: str
    eng: SimNode
    serving: set[str] = field(default_factory=set)
    loading: set[str] = field(default_factory=set)
    draining: set[str] = field(default_factory=set)
    adapters: set[str] = field(default_factory=set)
    ad_loading: set[str] = field(default_factory=set)
    on_since: float | None = None
    on_s: float = 0.0


@dataclass
class Tally:
    asked: float = 0.0
    ok: float = 0.0
    tokens_ok: float = 0.0
    cost: float = 0.0
    moving_asked: float = 0.0
    moving_ok: float = 0.0
    steady_asked: float = 0.0
    steady_ok: float = 0.0
    ad_steady: float = 0.0
    ad_steady_loaded: float = 0.0
    ad_asked: float = 0.0
    ad_loaded: float = 0.0
    refused: float = 0.0
    moves: int = 0
    moving_s: float = 0.0
    requests: int = 0

    def add(self, other: "Tally") -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


def simulate_window(nodes_spec, models: dict[str, Model], adapters_base: dict[str, str], row: dict[str, float],
                    old: tuple[dict, dict], target: tuple[dict, dict] | None, steady_s: float, seed: int,
                    cfg, on_demand: bool, span: float = WINDOW_S, urgent: frozenset[str] = frozenset(),
                    slo: tuple[dict[str, dict[str, float]], dict[str, float]] | None = None) -> Tally:
    """One window: ``old`` placement (models, adapters per node) until t = 0, then the moves to
    ``target`` (None: nothing moves), then ``steady_s`` more seconds. ``on_demand``: an adapter
    found nowhere is loaded where warmup (apply mode) would load it."""
    rng = random.Random(seed)
    nodes = [Node(i, nid, acc, SimNode(i, nid, SimProfile.for_type(acc))) for i, (nid, acc) in enumerate(nodes_spec)]
    by_id = {n.nid: n for n in nodes}
    old_m, old_a = old
    for n in nodes:
        n.serving = set(old_m.get(n.nid, ()))
        n.adapters = set(old_a.get(n.nid, ()))
        for m in n.serving:
            set_engine(n, models[m])
    names: list[str] = []
    weights: list[float] = []
    for name, r in row.items():
        if r > 0:
            names.append(name)
            weights.append(r)
    total = sum(weights)
    cum = []
    acc_w = 0.0
    for w in weights:
        acc_w += w
        cum.append(acc_w / total)
    views = [NodeView(state_of(n, CLOCK0 - WARM_S)) for n in nodes]
    rstate = RoutingState()
    heap: list[tuple[float, int, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, a: int = 0, b: object = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, a, b))

    # per request
    R_P: list[int] = []
    R_O: list[int] = []
    R_T: list[float] = []
    R_M: list[str] = []
    R_N: list[int] = []
    first: list[float] = []
    tally = Tally()
    moving = target is not None
    t_settled = 0.0 if not moving else math.inf
    t_end = steady_s if not moving else math.inf
    moving_keys: set[tuple[str, str, str]] = set()

    def refresh(n: Node, now: float) -> None:
        views[n.idx].state = state_of(n, now + CLOCK0)

    for n in nodes:
        push(rng.uniform(-WARM_S, -WARM_S + POLL_S), POLL, n.idx)
        if n.serving:
            n.on_since = 0.0
    push(-WARM_S + rng.expovariate(total), ARR)
    if moving:
        push(0.0, SWEEP)

    def start_prefill(n: Node, now: float) -> None:
        e = n.eng
        e.advance(now)
        if e.prefq:
            r = e.prefq.popleft()
            e.prefq_tok -= R_P[r]
            e.cur = r
            e.cur_end = now + R_P[r] / e.pf
            e.ver += 1
            push(e.cur_end, PREFILL, n.idx)
        else:
            e.ver += 1
            if e.decoding:
                push(now + (e.decoding[0][0] - e.vt) * e.step(len(e.decoding)), DECODE, n.idx, e.ver)

    def complete(n: Node, r: int, now: float) -> None:
        e = n.eng
        e.admitted -= 1
        e.outstanding -= 1
        views[n.idx].outstanding -= 1
        if e.waitq:
            r2 = e.waitq.popleft()
            e.waitq_tok -= R_P[r2]
            e.admitted += 1
            e.prefq.append(r2)
            e.prefq_tok += R_P[r2]
        if e.outstanding == 0 and n.draining:
            n.draining.clear()  # drained: unloaded
            account_off(n, now)

    def enqueue(n: Node, r: int, now: float) -> None:
        e = n.eng
        e.advance(now)
        e.outstanding += 1
        if e.admitted < e.maxc:
            e.admitted += 1
            e.prefq.append(r)
            e.prefq_tok += R_P[r]
        else:
            e.waitq.append(r)
            e.waitq_tok += R_P[r]
        if e.cur < 0:
            start_prefill(n, now)

    #: (node, adapter) -> requests waiting for the engine to load the adapter they name
    held_for: dict[tuple[int, str], list[int]] = {}

    def account_off(n: Node, now: float) -> None:
        if not (n.serving or n.loading or n.draining) and n.on_since is not None:
            n.on_s += max(0.0, now) - max(0.0, n.on_since)
            n.on_since = None

    def score(r: int, ok: bool, loaded: bool | None) -> None:
        t = R_T[r]
        if t < 0:
            return
        if DEBUG is not None:
            k = adapters_base.get(R_M[r], R_M[r])
            a_ok = DEBUG.setdefault(k, [0, 0])
            a_ok[0] += 1
            a_ok[1] += ok
        in_moves = t < t_settled
        w = 1.0
        tally.requests += 1
        tally.asked += w
        tokens = R_P[r] + R_O[r]
        if in_moves:
            tally.moving_asked += 1
            tally.moving_ok += ok
        else:
            tally.steady_asked += 1
            tally.steady_ok += ok
        if ok:
            tally.ok += 1
            tally.tokens_ok += tokens
        if loaded is not None:
            tally.ad_asked += 1
            tally.ad_loaded += loaded
            if not in_moves:
                tally.ad_steady += 1
                tally.ad_steady_loaded += loaded

    scored: list[tuple[int, bool, bool | None]] = []
    pending_score: dict[int, bool | None] = {}

    while heap:
        now, _, kind, a, b = heapq.heappop(heap)
        if now > t_end and not pending_score:
            break  # every request of the window has its first token
        if kind == ARR:
            if now > t_end:
                continue  # the window's last arrival is in: its queued requests finish
            r = len(R_P)
            u = rng.random()
            i = 0
            while cum[i] < u:
                i += 1
            name = names[i]
            base = adapters_base.get(name)
            m = models[base or name]
            R_P.append(max(16, int(rng.lognormvariate(math.log(m.prompt), PROMPT_SIGMA))))
            R_O.append(max(1, int(rng.lognormvariate(math.log(m.output), OUTPUT_SIGMA))))
            R_T.append(now)
            R_M.append(name)
            R_N.append(-1)
            first.append(math.nan)
            push(now + rng.expovariate(total), ARR)
            try:
                d = admit(views, RouteRequest(model=name, prompt_tokens=R_P[r], max_tokens=R_O[r], base=base), POLICY,
                          now + CLOCK0, rstate, stale_after_s=STALE, ttft_bound_s=BOUND)
            except (QueueFullError, NoHealthyNodesError):
                scored.append((r, False, True if base else None))  # served nowhere within the bound
                continue
            except ModelNotLoadedError:
                # nowhere: an adapter not loaded anywhere is refused and loaded on demand
                tally.refused += 1 if now >= 0 else 0
                scored.append((r, False, False if base else None))
                if base and on_demand:
                    home = adapter_home(cfg, {n.nid: views[n.idx].state for n in nodes}, name)
                    if home is not None and ("ad", home, name) not in moving_keys:
                        moving_keys.add(("ad", home, name))
                        by_id[home].ad_loading.add(name)
                        push(now + ADAPTER_LOAD_S, AD_LOADED, by_id[home].idx, name)
                continue
            n = by_id[d.node_id]
            R_N[r] = n.idx
            v = views[n.idx]
            v.outstanding += 1
            v.pending += 1
            if d.adapter_load_s > 0:  # the engine loads the adapter first (vLLM's LoRA resolver)
                pending_score[r] = False
                held_for.setdefault((n.idx, name), []).append(r)
                if name not in n.ad_loading:
                    n.ad_loading.add(name)
                    push(now + ADAPTER_LOAD_S, AD_LOADED, n.idx, name)
                continue
            pending_score[r] = True if base else None
            enqueue(n, r, now)
        elif kind == PREFILL:
            n = nodes[a]
            e = n.eng
            r = e.cur
            e.cur = -1
            e.last_t = now
            first[r] = now
            views[n.idx].pending -= 1
            scored.append((r, now - R_T[r] <= models[adapters_base.get(R_M[r], R_M[r])].ttft_s,
                           pending_score.pop(r, None)))
            o = R_O[r] - 1
            if o > 0:
                heapq.heappush(e.decoding, (e.vt + o, r))
            else:
                complete(n, r, now)
            start_prefill(n, now)
        elif kind == DECODE:
            n = nodes[a]
            e = n.eng
            if b != e.ver:
                continue
            e.vt = e.decoding[0][0]
            e.last_t = now
            while e.decoding and e.decoding[0][0] <= e.vt + EPS:
                _, r = heapq.heappop(e.decoding)
                complete(n, r, now)
            start_prefill(n, now)
        elif kind == POLL:
            n = nodes[a]
            refresh(n, now)
            push(now + POLL_S * rng.uniform(0.8, 1.2), POLL, n.idx)
        elif kind == LOADED:
            n = nodes[a]
            m = str(b)
            n.loading.discard(m)
            n.serving.add(m)
            set_engine(n, models[m])
            moving_keys.discard(("load", n.nid, m))
            refresh(n, now)
        elif kind == AD_LOADED:
            n = nodes[a]
            ad_name = str(b)
            n.ad_loading.discard(ad_name)
            moving_keys.discard(("ad", n.nid, ad_name))
            if adapters_base[ad_name] in n.serving or (n.idx, ad_name) in held_for:
                n.adapters.add(ad_name)
            for r in held_for.pop((n.idx, ad_name), ()):
                enqueue(n, r, now)
            refresh(n, now)
        elif kind == SWEEP:
            assert target is not None
            tgt_m, tgt_a = target
            for n in nodes:  # drained nodes: nothing left in flight
                if n.draining and n.eng.outstanding == 0:
                    n.draining.clear()
                    account_off(n, now)
            held = {n.nid: NodeNow(frozenset(n.serving | n.draining), frozenset(n.loading), frozenset(n.adapters),
                                   up=True, slots=1, adapter_slots=ADAPTER_SLOTS) for n in nodes}
            in_progress = sum(len(n.loading) for n in nodes)
            run, wait = next_steps(held, tgt_m, target_adapters=tgt_a, adapter_base=adapters_base,
                                   max_loads=MAX_LOADS, in_progress=in_progress, urgent=urgent,
                                   capacity=slo[0] if slo and EARLY else None, demand=slo[1] if slo else None)
            for st in run:
                n = by_id[st.node_id]
                key = (st.kind, st.node_id, st.name)
                if key in moving_keys:
                    continue
                if st.kind == "load":
                    if n.draining:  # its slot frees once the old model has unloaded
                        continue
                    moving_keys.add(key)
                    n.loading.add(st.name)
                    if n.on_since is None:
                        n.on_since = now
                    tally.moves += 1 if now >= 0 else 0
                    push(now + load_time(n.acc, models[st.name]), LOADED, n.idx, st.name)
                elif st.kind == "unload":
                    if st.name in n.draining:
                        continue
                    n.serving.discard(st.name)
                    n.adapters.clear()  # its adapters go with the base
                    n.draining.add(st.name)
                    tally.moves += 1 if now >= 0 else 0
                    if n.eng.outstanding == 0:
                        n.draining.clear()
                        account_off(n, now)
                    refresh(n, now)  # health takes it out of the routable models at once
                elif st.kind == "load_adapter":
                    if st.name in n.ad_loading or len(n.adapters) + len(n.ad_loading) >= ADAPTER_SLOTS:
                        continue
                    moving_keys.add(("ad", n.nid, st.name))
                    n.ad_loading.add(st.name)
                    push(now + ADAPTER_LOAD_S, AD_LOADED, n.idx, st.name)
                elif st.kind == "unload_adapter":
                    n.adapters.discard(st.name)
                    refresh(n, now)
            busy = any(n.loading or n.draining or n.ad_loading for n in nodes)
            # requests the moves left waiting for a slot are part of the moves: the steady sample
            # the rest of the window is scaled from starts once they are in (round 2 began it at
            # the last move and scaled that backlog's drain over the rest of the window)
            backlog = WAIT_BACKLOG and any(n.eng.waitq for n in nodes)
            if not run and not busy and not backlog or now >= MOVES_CAP_S:
                t_settled = now
                t_end = now + steady_s
                target = None  # settled (or given up): the rest of the window as it stands
            else:
                push(now + SWEEP_S, SWEEP)
    for r, ok, loaded in scored:
        score(r, ok, loaded)
    for r, loaded in pending_score.items():  # still waiting for a first token at the end
        score(r, False, loaded)
    # cost: nodes on, the moving part as simulated and the rest of the window as it ends
    steady_len = max(t_end - t_settled, 1e-9)
    rest = max(span - t_settled, 0.0)
    f = rest / steady_len  # the steady sample stands for the rest of the window
    on_moving = 0.0
    on_after = 0.0
    for n in nodes:
        price = ACCELERATORS[n.acc].cost_per_hour / 3600.0
        on = n.on_s
        if n.on_since is not None:
            on += max(0.0, t_settled) - max(0.0, n.on_since) if n.on_since < t_settled else 0.0
            on_after += price * rest
        on_moving += price * on
    tally.cost = on_moving + on_after
    tally.moving_s = t_settled
    # scale the steady part to the rest of the window
    sc = Tally()
    sc.asked = tally.moving_asked + tally.steady_asked * f
    sc.ok = tally.moving_ok + tally.steady_ok * f
    steady_tok = sum(R_P[r] + R_O[r] for r, ok, _ in scored if ok and R_T[r] >= t_settled)
    sc.tokens_ok = (tally.tokens_ok - steady_tok) + steady_tok * f
    sc.cost = tally.cost
    sc.moving_asked, sc.moving_ok = tally.moving_asked, tally.moving_ok
    sc.steady_asked, sc.steady_ok = tally.steady_asked * f, tally.steady_ok * f
    sc.ad_steady, sc.ad_steady_loaded = tally.ad_steady * f, tally.ad_steady_loaded * f
    sc.ad_asked = tally.ad_asked - tally.ad_steady + sc.ad_steady
    sc.ad_loaded = tally.ad_loaded - tally.ad_steady_loaded + sc.ad_steady_loaded
    sc.refused, sc.moves, sc.moving_s, sc.requests = tally.refused, tally.moves, tally.moving_s, tally.requests
    return sc


def set_engine(n: Node, m: Model) -> None:
    pf, dec, maxc, pen = engine(n.acc, m)
    e = n.eng
    e.pf, e.dec, e.maxc, e.pen = pf, dec, maxc, pen


def state_of(n: Node, now: float) -> NodeState:
    """What health publishes for the node: up, its routable models (the base it serves and the
    adapters loaded on it), its queue and its speeds for the model it holds."""
    e = n.eng
    routable = sorted(n.serving) + sorted(a for a in n.adapters)
    return NodeState(node_id=n.nid, accelerator_type=n.acc, family=ACCELERATORS[n.acc].family, endpoint="sim://",
                     backend="vllm", adapters_on_request=ON_REQUEST, adapter_slots=ADAPTER_SLOTS,
                     adapter_load_s=ADAPTER_LOAD_S,  # as measured: every load here takes it
                     status="up", models=routable, adapters=sorted(n.adapters), queue_running=e.admitted,
                     queue_waiting=len(e.waitq), max_concurrency=e.maxc, prefill_tps=e.pf, decode_tps=e.dec,
                     decode_slowdown=e.pen, cost_per_hour=ACCELERATORS[n.acc].cost_per_hour, health_score=100.0,
                     speeds_source="measured", updated_at=now, poll_interval_s=POLL_S)


# --- the day ------------------------------------------------------------------------------------
def day(seed: int, scale: int, n_windows: int, load: float):
    """(nodes, models, each window's demand, adapters, today's static placement of models and
    adapters, (cheapest family, fastest family)): what every strategy of either model runs on."""
    nodes = fleet(scale)
    models, demand, adapters = workload(seed, nodes, n_windows, load)
    peak = {m.name: max(row[m.name] for row in demand) for m in models}
    fams = {ACCELERATORS[a].family: ACCELERATORS[a] for _, a in nodes}
    static = static_placement(nodes, models, peak)
    _, day_ads = split(adapters, {m.name: sum(r[m.name] for r in demand) / len(demand) for m in models})
    static_ad = place_adapters(offers(nodes, models, static, {}, None, HEADROOM), static, day_ads)
    return (nodes, models, demand, adapters, (static, static_ad),
            (min(fams, key=lambda f: fams[f].cost_per_hour), max(fams, key=lambda f: fams[f].speed)))


def run(seed: int, scale: int, n_windows: int, steady_s: float, strategies: list[str], load: float,
        log=print) -> dict[str, dict[str, float]]:
    nodes, models, demand, adapters, (static, static_ad), (cheapest, fastest) = day(seed, scale, n_windows, load)
    mods = {m.name: m for m in models}
    adapters_base = {a: b for a, b, _ in adapters}
    cfg = parse_config({
        "nodes": [{"id": nid, "accelerator": acc, "endpoint": f"http://{nid}", "backend": "vllm",
                   "models": [m.name for m in models], "adapter_slots": ADAPTER_SLOTS} for nid, acc in nodes],
        "adapters": {a: {"base": b, "path": f"/lora/{a}"} for a, b, _ in adapters}})
    out: dict[str, dict[str, float]] = {}
    measured = Measured(seed, demand, adapters, LOOKAHEAD.trend_s) if ESTIMATED else None
    for name in strategies:
        fam = {"cheapest_family": {cheapest}, "fastest_family": {fastest}}.get(name)
        held, held_ad = dict(static), {n: a for n, a in static_ad.items() if a}
        tot = Tally()
        tgt: tuple[dict, dict] = (held, held_ad)
        plan_s: list[float] = []
        t0 = time.process_time()
        for w, row in enumerate(demand):
            wseed = seed * 100_003 + w  # the same arrivals for every strategy
            rows = {**{a.adapter: a.rate for a in split(adapters, row)[1]}, **split(adapters, row)[0]}
            if name == "static":
                tally = simulate_window(nodes, mods, adapters_base, rows, (static, static_ad), None, steady_s, wseed, cfg,
                                        False)
            else:
                short: set[str] = set()
                slo_now: list[tuple[dict[str, dict[str, float]], dict[str, float]]] = []

                def planned(seen: dict[str, float] | tuple[dict[str, float], list[AdapterDemand]]
                            ) -> tuple[dict, dict]:
                    base, ads = split(adapters, seen) if isinstance(seen, dict) else seen
                    params = PlanParams(move_cost_per_h=0.0 if name == "hindsight" else 0.25)
                    c0 = time.process_time()
                    offered = offers(nodes, models, held, held_ad, fam, HEADROOM)
                    demands = [ModelDemand(m, r) for m, r in base.items()]
                    p = plan(offered, demands, ads, params)
                    plan_s.append(time.process_time() - c0)
                    # the models warmup loads first: short of capacity where they are now
                    short.clear()
                    short.update(short_models(Inputs(offered, demands, ads, {})))
                    slo_now.clear()
                    slo_now.append(({o.node_id: o.capacity for o in offered}, placer_rates(demands, ads)))
                    return ({n: p.models.get(n, frozenset()) for n, _ in nodes},
                            {n: p.adapters.get(n, frozenset()) for n, _ in nodes})

                if name == "hindsight":
                    tgt = planned(row)
                    tally = simulate_window(nodes, mods, adapters_base, rows, tgt, None, steady_s, wseed, cfg, False)
                else:
                    # the planner's demand window still shows the last window's rate at its start
                    # and only the new one from REPLAN_S on: a plan on each, each moving while
                    # requests flow (or, planner_instant, in place at once)
                    instant = name == "planner_instant"
                    tally = Tally()
                    ends = [*REPLANS[1:], WINDOW_S]
                    prev = demand[w - 1] if w else row
                    for k, (t0_seg, t1_seg) in enumerate(zip(REPLANS, ends)):
                        span = t1_seg - t0_seg
                        f_new = min(1.0, t0_seg / REPLAN_S)  # the demand window's share of this window's rate
                        seen = row if f_new >= 1 else prev if f_new <= 0 else \
                            {m: (1 - f_new) * prev[m] + f_new * row[m] for m in row}
                        if measured is not None:  # what the demand window shows then, looked ahead
                            seen = as_demands(adapters, measured.planned(w * WINDOW_S + t0_seg, LOOKAHEAD))
                        tgt = planned(seen)
                        seg = simulate_window(nodes, mods, adapters_base, rows, tgt if instant else (held, held_ad),
                                              None if instant else tgt, steady_s, wseed + 7 * k, cfg, True, span,
                                              frozenset(short), slo_now[0])
                        tally.add(seg)
                        held, held_ad = {n: ms for n, ms in tgt[0].items() if ms}, {n: a for n, a in tgt[1].items() if a}
                    tally.moving_s /= len(REPLANS)  # (per window below: the mean of its segments' moves)
                if name == "hindsight":
                    held, held_ad = {n: ms for n, ms in tgt[0].items() if ms}, {n: a for n, a in tgt[1].items() if a}
            tot.add(tally)
        tokens = tot.tokens_ok
        out[name] = {
            "cost_usd": round(tot.cost, 2),
            "slo_attainment": round(tot.ok / tot.asked, 5),
            "usd_per_1m_tokens": round(tot.cost / (tokens / 1e6), 5) if tokens else float("inf"),
            "slo_while_moving": round(tot.moving_ok / tot.moving_asked, 5) if tot.moving_asked else None,
            "slo_steady": round(tot.steady_ok / tot.steady_asked, 5) if tot.steady_asked else None,
            "moving_requests": int(tot.moving_asked),
            "adapter_loaded_steady": round(tot.ad_steady_loaded / tot.ad_steady, 5) if tot.ad_steady else None,
            "adapter_loaded_all": round(tot.ad_loaded / tot.ad_asked, 5) if tot.ad_asked else None,
            "refused_not_loaded": int(tot.refused),
            "moves": tot.moves,
            "mean_moving_s": round(tot.moving_s / n_windows, 1),
            "plan_cpu_s_mean": round(sum(plan_s) / len(plan_s), 4) if plan_s else 0.0,
            "requests_simulated": tot.requests,
            "sim_cpu_s": round(time.process_time() - t0, 1),
        }
        r = out[name]
        log(f"  {name:<16} ${r['cost_usd']:>9.2f}  SLO {r['slo_attainment']:7.2%}  ${r['usd_per_1m_tokens']:.4f}/1M  "
            f"moving {r['slo_while_moving'] if r['slo_while_moving'] is not None else '-'} "
            f"steady {r['slo_steady']}  adapters {r['adapter_loaded_steady']}  moves {r['moves']}  "
            f"reqs {r['requests_simulated']}  cpu {r['sim_cpu_s']} s")
    return out


# --- the same day, per window (a fluid model), where request by request is too slow ------------
def run_fluid(seed: int, scale: int, n_windows: int, strategies: list[str], load: float,
              log=print) -> dict[str, dict[str, float]]:
    """The day per 30-minute window: a model's requests are served within SLO up to its nodes'
    saturation capacity (``slo_capacity`` at headroom 1: a node's time shared among its models),
    the rest miss; a model gaining replicas keeps only its old ones' capacity for the new ones'
    load time; an adapter request counts as served where loaded when its adapter is on a node of
    its base in the plan. Same workload, fleet, plans and strategies as :func:`run`."""
    nodes, models, demand, adapters, (static, static_ad), (cheapest, fastest) = day(seed, scale, n_windows, load)
    acc_of = dict(nodes)
    mods = {m.name: m for m in models}
    full = {(nid, m.name): capacity(acc, m, 1.0) for nid, acc in nodes for m in models}
    out: dict[str, dict[str, float]] = {}
    for name in strategies:
        fam = {"cheapest_family": {cheapest}, "fastest_family": {fastest}}.get(name)
        held, held_ad = dict(static), {n: a for n, a in static_ad.items() if a}
        t = {"cost": 0.0, "asked": 0.0, "ok": 0.0, "tokens": 0.0, "ok_instant": 0.0, "ad": 0.0, "ad_loaded": 0.0,
             "moves": 0}
        plan_s: list[float] = []
        for w, row in enumerate(demand):
            if name == "static":
                segments = [(row, WINDOW_S, False)]
            elif name == "hindsight":
                segments = [(row, WINDOW_S, False)]
            else:  # as run(): a plan on the last window's rate, then one on this window's
                segments = [(demand[w - 1] if w else row, REPLAN_S, True), (row, WINDOW_S - REPLAN_S, True)]
            for seen, span, moving in segments:
                if name == "static":
                    placed, placed_ad = static, static_ad
                else:
                    base, ads = split(adapters, seen)
                    params = PlanParams(move_cost_per_h=0.0 if name == "hindsight" else 0.25)
                    c0 = time.process_time()
                    p = plan(offers(nodes, models, held, held_ad, fam, HEADROOM),
                             [ModelDemand(m, r) for m, r in base.items()], ads, params)
                    plan_s.append(time.process_time() - c0)
                    placed = {n: ms for n, ms in p.models.items() if ms}
                    placed_ad = p.adapters
                cap: dict[str, float] = {}
                old_cap: dict[str, float] = {}
                slowest: dict[str, float] = {}
                for n, ms in placed.items():
                    t["cost"] += ACCELERATORS[acc_of[n]].cost_per_hour * span / 3600
                    for m in ms:
                        cap[m] = cap.get(m, 0.0) + full[(n, m)] / len(ms)
                        if moving and m not in held.get(n, ()):
                            slowest[m] = max(slowest.get(m, 0.0), load_time(acc_of[n], mods[m]))
                            t["moves"] += 1
                for n, ms in held.items():
                    for m in ms:
                        old_cap[m] = old_cap.get(m, 0.0) + full[(n, m)] / len(ms)
                _, actual_ads = split(adapters, row)
                for m, r in row.items():
                    c = cap.get(m, 0.0)
                    ok_inst = min(r, c)
                    f = min(1.0, slowest.get(m, 0.0) / span)
                    ok = (1 - f) * ok_inst + f * min(r, old_cap.get(m, 0.0)) if m in slowest else ok_inst
                    t["asked"] += r * span
                    t["ok"] += ok * span
                    t["ok_instant"] += ok_inst * span
                    t["tokens"] += ok * span * (mods[m].prompt + mods[m].output)
                for a in actual_ads:
                    t["ad"] += a.rate * span
                    if any(a.adapter in placed_ad.get(n, ()) for n, ms in placed.items() if a.base in ms):
                        t["ad_loaded"] += a.rate * span
                if name != "static":
                    held, held_ad = placed, {n: a for n, a in placed_ad.items() if a}
        out[name] = {
            "cost_usd": round(t["cost"], 2),
            "slo_attainment": round(t["ok"] / t["asked"], 5),
            "slo_attainment_instant_moves": round(t["ok_instant"] / t["asked"], 5),
            "usd_per_1m_tokens": round(t["cost"] / (t["tokens"] / 1e6), 5),
            "adapter_loaded": round(t["ad_loaded"] / t["ad"], 5) if t["ad"] else None,
            "moves": t["moves"],
            "plan_cpu_s_mean": round(sum(plan_s) / len(plan_s), 4) if plan_s else 0.0,
        }
        r = out[name]
        log(f"  {name:<16} ${r['cost_usd']:>10.2f}  SLO {r['slo_attainment']:7.2%} (instant moves "
            f"{r['slo_attainment_instant_moves']:.2%})  ${r['usd_per_1m_tokens']:.4f}/1M  adapters {r['adapter_loaded']}"
            f"  loads {r['moves']}  plan {r['plan_cpu_s_mean'] * 1000:.0f} ms")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=15, help="copies of the demo fleet's mix (15: 105 nodes)")
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--steady", type=float, default=60.0, help="seconds simulated per window after its moves")
    ap.add_argument("--load", type=float, default=LOAD)
    ap.add_argument("--headroom", type=float, default=0.8, help="[planner] headroom")
    ap.add_argument("--miss-share", type=float, default=0.01, help="[planner] ttft_miss_share")
    ap.add_argument("--seeds", type=int, nargs="+", default=[21])
    ap.add_argument("--strategies", nargs="+",
                    default=["static", "planner", "planner_instant", "hindsight", "cheapest_family", "fastest_family"])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--fluid", action="store_true",
                    help="per window with the fluid model (run_fluid) instead of request by request")
    ap.add_argument("--no-adapters-on-request", action="store_true",
                    help="engines without a LoRA resolver: an adapter found nowhere is refused, then loaded")
    ap.add_argument("--no-backlog-wait", action="store_true",
                    help="round 2's sampling: the steady sample starts at the last move, backlog or not")
    ap.add_argument("--no-stand-ins", action="store_true",
                    help="round 2's executor: urgent loads wait for a full node's model to move (no stand-ins)")
    ap.add_argument("--true-rates", action="store_true",
                    help="round 3's input: the planner given each window's true rates, not its demand window's")
    ap.add_argument("--replans", type=float, nargs="+", default=[0.0, REPLAN_S],
                    help="plans simulated per window, seconds into it (request by request only)")
    ap.add_argument("--horizon", type=float, default=0.0, help="[planner] forecast_horizon_s")
    ap.add_argument("--trend", type=float, default=3600.0, help="[planner] trend_s")
    ap.add_argument("--spread", type=float, default=0.0, help="[planner] forecast_spread")
    ap.add_argument("--plan-time", action="store_true",
                    help="only time plans: 1,000 nodes x 50 models x 500 adapters, 5 runs")
    args = ap.parse_args()
    global HEADROOM, MISS_SHARE, ON_REQUEST, EARLY, WAIT_BACKLOG, ESTIMATED, LOOKAHEAD, REPLANS
    REPLANS = sorted(set(args.replans) | {0.0})
    ESTIMATED = not args.true_rates
    LOOKAHEAD = Lookahead(args.horizon, args.trend, args.spread)
    WAIT_BACKLOG = not args.no_backlog_wait
    EARLY = not args.no_stand_ins
    HEADROOM, MISS_SHARE = args.headroom, args.miss_share
    ON_REQUEST = not args.no_adapters_on_request
    if args.plan_time:
        took = plan_time()
        print(f"plan, 1,000 nodes x 50 models x 500 adapters: CPU s {[round(t, 3) for t in took]}, "
              f"median {sorted(took)[len(took) // 2]:.3f} s")
        return
    out = {}
    for seed in args.seeds:
        print(f"seed {seed}, {len(fleet(args.scale))} nodes, {args.windows} windows, "
              + ("per window (fluid)" if args.fluid else f"per request, steady {args.steady:g} s") + ":", flush=True)
        if args.fluid:
            res = run_fluid(seed, args.scale, args.windows, args.strategies, args.load,
                            log=lambda s: print(s, flush=True))
        else:
            res = run(seed, args.scale, args.windows, args.steady, args.strategies, args.load,
                      log=lambda s: print(s, flush=True))
        out[str(seed)] = res
        if "static" in res and "planner" in res and "hindsight" in res:
            st, pl, hs = res["static"], res["planner"], res["hindsight"]
            print(f"  planner vs static: {1 - pl['usd_per_1m_tokens'] / st['usd_per_1m_tokens']:.1%} lower $/1M; "
                  f"vs hindsight: {pl['usd_per_1m_tokens'] / hs['usd_per_1m_tokens'] - 1:+.1%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
