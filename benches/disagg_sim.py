"""Disaggregated prefill/decode on a mixed fleet, in virtual time, with the router's own code.

Each request is routed by ``zmlcore.policy.choose_node`` (the aggregated route) and, for the
``zml`` mode, ``zmlcore.policy.split.decide_split`` (whole, or which prefill/decode pair) over
``NodeView`` objects whose counters the simulator keeps as the router keeps them. Nodes follow
the reference fleet model (``zmlcore.fleet.perfmodel.SimProfile``, as ``zml sim`` does): a
FIFO of prefills one at a time that pause decode, continuous-batching decode steps of
``(1 + 0.02 (b-1)) / decode_tps``, ``max_concurrency`` slots. A split request's prefill leg
holds a slot on its prefill node for its prefill; its KV then crosses the pair's link (KV
bytes / bandwidth) and the decode leg takes a slot on the decode node, computes one token and
decodes. No prefix cache (every prompt is new: the RAG and summarisation case).

Modes:
* ``aggregated``: today's routing, every node serves whole requests (the latency policy);
* ``fixed``: the homogeneous anchors' way: one family prefills, the rest decode, every request
  split (least-loaded prefill node, least-loaded decode node);
* ``zml``: every node may take either leg; per request the decider splits or not, and over
  which pair, from speeds, queues, links and prices;
* ``zml_slo``: the router's path for requests with targets: flow control's SLO admission (a
  whole node that meets them, else the decider's best pair if it does, else refused), then the
  decider against the node admission chose.

Goodput: requests whose TTFT <= 2 s and mean ITL <= 50 ms. The fleet costs the same in every
mode, so goodput per $ compares as goodput does. Run::

    python benches/disagg_sim.py --workload long --seeds 101 102 103
    python benches/disagg_sim.py --workload chat
    python benches/disagg_sim.py --decide-bench      # decision time, 1,000 nodes
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from zmlcore.errors import RoutingError
from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.fleet.perfmodel import SimProfile
from zmlcore.flowctl.slo import Pairs, Slo, admit_slo
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.split import KVLinks, SplitIndex, SplitSettings, decide_split

MODEL = "m"
#: aggregated: whole requests, the latency policy; aggregated_slo: the same told the requests'
#: TTFT and inter-token targets (flow control's SLO admission: a pick that meets them, else
#: the fastest that does, else refused); fixed: family roles; zml: the per-request decider;
#: zml_slo: SLO admission told it may split (a pair before refusing), then the decider.
MODES = ("aggregated", "aggregated_slo", "fixed", "zml", "zml_slo")
TTFT_SLO = 2.0
ITL_SLO = 0.050
KV_BYTES = 131072.0
#: The inter-token target the zml mode's decider is told (the requests' SLO); inf: none
#: (``--itl-target-ms 0``, the decider as it was before it read one).
DECIDER_ITL_TARGET = ITL_SLO
#: The demo fleet (sdk/src/zml/data/demo.toml): 2 H100, 1 A100, 2 MI300X, 1 Gaudi2, 1 Inferentia2.
DEMO = ["nvidia_h100", "nvidia_h100", "nvidia_a100", "amd_mi300x", "amd_mi300x", "intel_gaudi2", "aws_inferentia2"]
#: A larger mix: 4x each of the GPU kinds, 6 Gaudi2, 8 Inferentia2.
LARGE = ["nvidia_h100"] * 4 + ["nvidia_a100"] * 4 + ["amd_mi300x"] * 4 + ["intel_gaudi2"] * 6 + ["aws_inferentia2"] * 8


@dataclass(slots=True)
class Job:
    rid: int
    arrival: float
    prompt: int
    out: int
    kind: str = "whole"  # whole | prefill | decode
    node: int = -1
    decode_node: int = -1
    first: float = -1.0
    done: float = -1.0
    generated: int = 0
    parent: Job | None = None
    split: bool = False


@dataclass(slots=True)
class Node:
    idx: int
    view: NodeView
    prof: SimProfile
    waitq: deque[Job] = field(default_factory=deque)
    prefq: deque[Job] = field(default_factory=deque)
    decoding: list[Job] = field(default_factory=list)
    admitted: int = 0
    busy: bool = False
    action: str = ""
    current: Job | None = None
    batch: list[Job] = field(default_factory=list)
    pending_tokens: float = 0.0

    def step(self, b: int) -> float:
        return (1.0 + self.prof.batch_penalty * (b - 1)) / self.prof.decode_tps


class Sim:
    def __init__(self, accels: list[str], mode: str, seed: int, gbps: float, prefill_families: frozenset[str],
                 settings: SplitSettings, itl_target: float | None = None) -> None:
        self.mode = mode
        #: the requests' inter-token target as the decider is told it (their SLO: x-zml-tpot-slo-ms)
        self.itl_target = DECIDER_ITL_TARGET if itl_target is None else itl_target
        self.settings = settings
        self.links = KVLinks()
        self.gbps = gbps
        self.nodes: list[Node] = []
        for i, acc in enumerate(accels):
            prof = SimProfile.for_type(acc)
            fam = ACCELERATORS[acc].family
            roles: list[str] = []
            if mode == "fixed":
                roles = ["prefill"] if fam in prefill_families else ["decode"]
            st = NodeState(node_id=f"{fam.lower()}-{i}", accelerator_type=acc, family=fam, endpoint="",
                           status="up", models=[MODEL], prefill_tps=prof.prefill_tps, decode_tps=prof.decode_tps,
                           max_concurrency=prof.max_concurrency, cost_per_hour=prof.cost_per_hour,
                           roles=roles, kv_group="g" if not mode.startswith("aggregated") else "", kv_gbps=gbps,
                           updated_at=0.0)
            v = NodeView(st)
            v.pending_tokens = 0.0
            self.nodes.append(Node(i, v, prof))
        self.by_id = {n.view.node_id: n for n in self.nodes}
        self.views = [n.view for n in self.nodes]
        self.policy = builtin_policy("latency")
        self.rstate = RoutingState()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.now = 0.0
        self.rng = random.Random(seed)
        self.done: list[Job] = []
        self.refused = 0
        self.splits = 0
        #: zml_slo: requests SLO admission split (no whole node met their targets)
        self.slo_splits = 0
        self.decide_s: list[float] = []

    # --- events ----------------------------------------------------------------------------
    def at(self, t: float, kind: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def run(self, jobs: list[Job]) -> None:
        for j in jobs:
            self.at(j.arrival, "arrive", j)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "arrive":
                assert isinstance(payload, Job)
                self.route(payload)
            elif kind == "node":
                assert isinstance(payload, Node)
                self.node_done(payload)
            elif kind == "kv":
                assert isinstance(payload, Job)
                self.enqueue(self.nodes[payload.node], payload)

    # --- routing (the router's code) -------------------------------------------------------
    def route(self, j: Job) -> None:
        t0 = time.perf_counter()
        try:
            if self.mode == "fixed":
                pre = min((n for n in self.nodes if "prefill" in n.view.state.roles),
                          key=lambda n: ((n.view.pending_tokens or 0.0) / n.prof.prefill_tps, n.idx))
                dec = min((n for n in self.nodes if "decode" in n.view.state.roles),
                          key=lambda n: (n.view.effective_outstanding() / n.prof.max_concurrency, n.idx))
                pair: tuple[Node, Node] | None = (pre, dec)
                whole = None
            elif self.mode == "aggregated_slo":  # whole, told the requests' targets (flow control's SLO admission)
                d, _ = admit_slo(self.views, RouteRequest(model=MODEL, prompt_tokens=j.prompt, max_tokens=j.out),
                                 self.policy, self.now, self.rstate, Slo(TTFT_SLO, ITL_SLO), stale_after_s=math.inf,
                                 ttft_bound_s=60.0)
                whole, pair = self.by_id[d.node_id], None
            elif self.mode == "zml_slo":  # the router's path for a request with targets
                d, _ = admit_slo(self.views, RouteRequest(model=MODEL, prompt_tokens=j.prompt, max_tokens=j.out),
                                 self.policy, self.now, self.rstate, Slo(TTFT_SLO, ITL_SLO), stale_after_s=math.inf,
                                 ttft_bound_s=60.0, pairs=Pairs(self.views, self.settings, self.links))
                whole, pair = self.by_id[d.node_id], None
                if d.prefill_node:  # no whole node meets the targets, this pair does
                    pair, whole = (self.by_id[d.prefill_node], self.by_id[d.node_id]), None
                    self.slo_splits += 1
                else:  # the decider against the node admission chose
                    sd = decide_split(self.views, whole.view, model=MODEL, prompt_tokens=j.prompt,
                                      output_tokens=j.out, cached={}, settings=self.settings, links=self.links,
                                      now=self.now, stale_after_s=math.inf, latency_target_s=TTFT_SLO,
                                      itl_target_s=self.itl_target)
                    if sd.split and sd.chosen is not None:
                        pair = (self.by_id[sd.chosen.prefill_node], self.by_id[sd.chosen.node])
            else:
                d = choose_node(self.views, RouteRequest(model=MODEL, prompt_tokens=j.prompt, max_tokens=j.out),
                                self.policy, self.now, self.rstate, stale_after_s=math.inf)
                whole = self.by_id[d.node_id]
                pair = None
                if self.mode == "zml":
                    sd = decide_split(self.views, whole.view, model=MODEL, prompt_tokens=j.prompt,
                                      output_tokens=j.out, cached={}, settings=self.settings, links=self.links,
                                      now=self.now, stale_after_s=math.inf, latency_target_s=TTFT_SLO,
                                      itl_target_s=self.itl_target)
                    if sd.split and sd.chosen is not None:
                        pair = (self.by_id[sd.chosen.prefill_node], self.by_id[sd.chosen.node])
        except RoutingError:
            self.refused += 1
            return
        finally:
            self.decide_s.append(time.perf_counter() - t0)
        if pair is None:
            assert whole is not None
            j.node = whole.idx
            self.dispatch(whole, j, j.prompt)
            self.enqueue(whole, j)
            return
        pre, dec = pair
        self.splits += 1
        j.split = True
        leg = Job(j.rid, j.arrival, j.prompt, 1, kind="prefill", node=pre.idx, decode_node=dec.idx, parent=j)
        j.kind, j.node = "decode", dec.idx
        self.dispatch(pre, leg, j.prompt)
        self.dispatch(dec, j, 1)
        self.enqueue(pre, leg)

    def dispatch(self, n: Node, j: Job, tokens: float) -> None:
        v = n.view
        v.set_counts(v.outstanding + 1, v.pending + 1, (v.pending_tokens or 0.0) + tokens)

    def first_token(self, n: Node, tokens: float) -> None:
        v = n.view
        v.set_counts(v.outstanding, v.pending - 1, max(0.0, (v.pending_tokens or 0.0) - tokens))

    def finished(self, n: Node) -> None:
        v = n.view
        v.outstanding -= 1

    # --- node dynamics ---------------------------------------------------------------------
    def enqueue(self, n: Node, j: Job) -> None:
        n.waitq.append(j)
        self.kick(n)

    def kick(self, n: Node) -> None:
        if n.busy:
            return
        while n.waitq and n.admitted < n.prof.max_concurrency:
            n.admitted += 1
            n.prefq.append(n.waitq.popleft())
        if n.prefq:
            j = n.prefq.popleft()
            tokens = 1 if j.kind == "decode" else j.prompt
            n.busy, n.action, n.current = True, "prefill", j
            self.at(self.now + max(tokens, 1) / n.prof.prefill_tps, "node", n)
        elif n.decoding:
            n.busy, n.action, n.batch = True, "decode", list(n.decoding)
            self.at(self.now + n.step(len(n.batch)), "node", n)

    def node_done(self, n: Node) -> None:
        n.busy = False
        if n.action == "prefill":
            j = n.current
            assert j is not None
            n.current = None
            if j.kind == "prefill":  # a prefill leg: its KV goes to the decode node, the slot frees
                n.admitted -= 1
                self.first_token(n, j.prompt)
                self.finished(n)
                d = j.parent
                assert d is not None
                xfer = j.prompt * KV_BYTES / (self.gbps * 1e9 / 8.0)
                self.at(self.now + xfer, "kv", d)
            else:
                j.first = self.now
                j.generated = 1
                self.first_token(n, 1 if j.kind == "decode" else j.prompt)
                if j.generated >= j.out:
                    self.finish(n, j)
                else:
                    n.decoding.append(j)
        else:
            for j in n.batch:
                j.generated += 1
                if j.generated >= j.out:
                    n.decoding.remove(j)
                    self.finish(n, j)
            n.batch = []
        self.kick(n)

    def finish(self, n: Node, j: Job) -> None:
        j.done = self.now
        n.admitted -= 1
        self.finished(n)
        self.done.append(j)


def workload(kind: str, rate: float, duration: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    t, out, i = 0.0, [], 0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        if kind == "long":  # RAG, agents, summarisation: long prompts, shortish answers
            p = int(min(7500, max(1500, rng.lognormvariate(math.log(4000), 0.4))))
            o = int(min(600, max(16, rng.lognormvariate(math.log(150), 0.5))))
        else:  # chat
            p = int(min(2000, max(20, rng.lognormvariate(math.log(250), 0.7))))
            o = int(min(800, max(16, rng.lognormvariate(math.log(250), 0.6))))
        out.append(Job(i, t, p, o))
        i += 1


def goodput(jobs: list[Job], n_total: int) -> dict[str, float]:
    good = 0
    ttfts, itls = [], []
    for j in jobs:
        ttft = j.first - j.arrival
        itl = (j.done - j.first) / (j.out - 1) if j.out > 1 else 0.0
        ttfts.append(ttft)
        itls.append(itl)
        good += ttft <= TTFT_SLO and itl <= ITL_SLO
    return {"good": good, "goodput_share": good / n_total, "completed": len(jobs) / n_total,
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0,
            "ttft_p99": sorted(ttfts)[int(0.99 * (len(ttfts) - 1))] if ttfts else 0.0,
            "itl_p50": statistics.median(itls) if itls else 0.0,
            "itl_p99": sorted(itls)[int(0.99 * (len(itls) - 1))] if itls else 0.0}


def capacity_rps(accels: list[str], kind: str) -> float:
    """The fleet's aggregated saturation throughput for the workload's mean sizes."""
    mp, mo = (4300.0, 170.0) if kind == "long" else (320.0, 300.0)
    return sum(SimProfile.for_type(a).capacity_rps(mp, mo) for a in accels)


def run_mode(accels: list[str], kind: str, mode: str, rate: float, seed: int, duration: float, gbps: float,
             prefill_families: frozenset[str], settings: SplitSettings) -> dict[str, float]:
    jobs = workload(kind, rate, duration, seed)
    sim = Sim(accels, mode, seed, gbps, prefill_families, settings)
    sim.run(jobs)
    g = goodput(sim.done, len(jobs))
    cost_h = sum(SimProfile.for_type(a).cost_per_hour for a in accels)
    g["split_share"] = sim.splits / max(1, len(jobs))
    g["slo_split_share"] = sim.slo_splits / max(1, len(jobs))
    g["refused_share"] = sim.refused / max(1, len(jobs))
    g["goodput_per_dollar"] = g["good"] / (cost_h * duration / 3600.0)
    g["decide_us_p50"] = statistics.median(sim.decide_s) * 1e6 if sim.decide_s else 0.0
    return g


def fixed_role_choices(accels: list[str]) -> list[frozenset[str]]:
    """Every family alone and every two families together as the prefill pool (the rest decode)."""
    fams = sorted({ACCELERATORS[a].family for a in accels})
    return [frozenset([f]) for f in fams] + [frozenset(c) for c in itertools.combinations(fams, 2)]


def run_one(accels: list[str], kind: str, load: float, seed: int, duration: float, gbps: float,
            settings: SplitSettings, fixed: frozenset[str]) -> dict[str, dict[str, float]]:
    rate = load * capacity_rps(accels, kind)
    res = {}
    for mode in MODES:
        res[mode] = run_mode(accels, kind, mode, rate, seed, duration, gbps, fixed, settings)
    return res


def best_fixed(accels: list[str], kind: str, load: float, seed: int, duration: float, gbps: float,
               settings: SplitSettings) -> frozenset[str]:
    """The fixed role assignment with the best goodput on a tuning seed (an operator's best
    static split; the held-out seeds then measure it)."""
    rate = load * capacity_rps(accels, kind)
    scored = [(run_mode(accels, kind, "fixed", rate, seed, duration, gbps, f, settings)["good"], sorted(f))
              for f in fixed_role_choices(accels)]
    return frozenset(max(scored)[1])


def decide_bench(n_nodes: int = 1000, reps: int = 2000) -> dict[str, float]:
    """decide_split's time over a fleet of ``n_nodes`` (every node either role, one kv_group)."""
    rng = random.Random(5)
    kinds = list(ACCELERATORS)[:5]
    views = []
    for i in range(n_nodes):
        acc = kinds[i % len(kinds)]
        prof = SimProfile.for_type(acc)
        v = NodeView(NodeState(node_id=f"n{i}", accelerator_type=acc, family=acc, endpoint="", status="up",
                               models=[MODEL], prefill_tps=prof.prefill_tps, decode_tps=prof.decode_tps,
                               max_concurrency=prof.max_concurrency, cost_per_hour=prof.cost_per_hour,
                               kv_group="g", kv_gbps=100.0, updated_at=0.0))
        v.outstanding = rng.randrange(0, prof.max_concurrency)
        views.append(v)
    settings, links = SplitSettings(), KVLinks()
    t0 = time.perf_counter()
    index = SplitIndex(views)
    out: dict[str, float] = {"nodes": n_nodes, "index_build_ms": (time.perf_counter() - t0) * 1e3}
    for name, idx, objective in (("scan", None, "latency"), ("index", index, "latency"),
                                 ("index_cost", index, "cost")):
        times = []
        for r in range(reps if idx is not None else max(20, reps // 20)):
            whole = views[r % n_nodes]
            whole.outstanding = (whole.outstanding + 1) % 16  # a counter changes per decision, as dispatch does
            t0 = time.perf_counter()
            decide_split(views, whole, model=MODEL, prompt_tokens=4000, output_tokens=200, cached={},
                         settings=settings, links=links, now=0.0, stale_after_s=math.inf, index=idx,
                         objective=objective)  # type: ignore[arg-type]
            times.append(time.perf_counter() - t0)
        out[f"{name}_median_us"] = statistics.median(times) * 1e6
        out[f"{name}_p99_us"] = sorted(times)[int(0.99 * (len(times) - 1))] * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["long", "chat"], default="long")
    ap.add_argument("--fleet", choices=["demo", "large"], default="demo")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the aggregated capacity")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[101, 102, 103])
    ap.add_argument("--gbps", type=float, default=100.0)
    ap.add_argument("--tune-seed", type=int, default=7, help="seed on which the best fixed role assignment is chosen")
    ap.add_argument("--min-gain", type=float, default=0.1)
    ap.add_argument("--min-uncached", type=int, default=512, help="[disaggregation] min_uncached_tokens")
    ap.add_argument("--itl-target-ms", type=float, default=ITL_SLO * 1000,
                    help="the requests' inter-token target as the decider is told it (0: none)")
    ap.add_argument("--decide-bench", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    global DECIDER_ITL_TARGET
    DECIDER_ITL_TARGET = a.itl_target_ms / 1000 if a.itl_target_ms > 0 else math.inf
    if a.decide_bench:
        print(json.dumps(decide_bench()))
        return
    accels = DEMO if a.fleet == "demo" else LARGE
    settings = SplitSettings(min_uncached_tokens=a.min_uncached, min_gain=a.min_gain)
    fixed = best_fixed(accels, a.workload, a.load, a.tune_seed, a.duration, a.gbps, settings)
    rows = [run_one(accels, a.workload, a.load, s, a.duration, a.gbps, settings, fixed) for s in a.seeds]
    summary = {}
    for mode in MODES:
        summary[mode] = {k: statistics.mean(r[mode][k] for r in rows) for k in rows[0][mode]}
    summary["fixed_prefill_families"] = sorted(fixed)  # type: ignore[assignment]
    summary["zml_vs_aggregated"] = {"goodput_per_dollar": summary["zml"]["goodput_per_dollar"] /
                                    max(1e-9, summary["aggregated"]["goodput_per_dollar"])}
    summary["zml_vs_aggregated_slo"] = {"goodput_per_dollar": summary["zml"]["goodput_per_dollar"] /
                                        max(1e-9, summary["aggregated_slo"]["goodput_per_dollar"])}
    summary["zml_slo_vs_aggregated_slo"] = {"goodput_per_dollar": summary["zml_slo"]["goodput_per_dollar"] /
                                            max(1e-9, summary["aggregated_slo"]["goodput_per_dollar"])}
    summary["zml_vs_fixed"] = {"goodput_per_dollar": summary["zml"]["goodput_per_dollar"] /
                               max(1e-9, summary["fixed"]["goodput_per_dollar"])}
    if a.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"workload={a.workload} fleet={a.fleet} load={a.load} seeds={a.seeds} gbps={a.gbps} "
          f"fixed prefill families={sorted(fixed)} (best on seed {a.tune_seed})")
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:>14}: goodput {s['goodput_share']:.3f}  good/$ {s['goodput_per_dollar']:.1f}  "
              f"completed {s['completed']:.3f}  TTFT p50 {s['ttft_p50']:.2f}s p99 {s['ttft_p99']:.2f}s  "
              f"ITL p50 {s['itl_p50'] * 1e3:.0f}ms p99 {s['itl_p99'] * 1e3:.0f}ms  split {s['split_share']:.2f} "
              f"(by SLO admission {s['slo_split_share']:.3f})  refused {s['refused_share']:.3f}  "
              f"decide p50 {s['decide_us_p50']:.0f}us")
    print(f"zml/aggregated goodput per $: {summary['zml_vs_aggregated']['goodput_per_dollar']:.2f}x; "
          f"zml/aggregated_slo: {summary['zml_vs_aggregated_slo']['goodput_per_dollar']:.2f}x; "
          f"zml/fixed: {summary['zml_vs_fixed']['goodput_per_dollar']:.2f}x; "
          f"zml_slo/aggregated_slo: {summary['zml_slo_vs_aggregated_slo']['goodput_per_dollar']:.2f}x")


if __name__ == "__main__":
    main()
