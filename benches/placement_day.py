"""A day of demand on a mixed fleet: the placement planner vs today's static placement, one
family only, and a hindsight optimum, with the planner's own code (``zmlcore.placement``).

Fleet: the demo fleet's mix (4 H100 : 4 MI300X : 2 A100 : 2 Gaudi2 : 1 Inferentia2) scaled to
``--nodes``, priced and sped as ``zmlcore.fleet.accelerators`` says. 20 models of three sizes
(8B-like: speed x1, 16 GiB; 2x slower and 32 GiB; 4x slower and 70 GiB), each with its own
prompt/output sizes and a TTFT target of 2 s, and 100 LoRA adapters on them (Zipf shares).
Demand: 96 windows of 15 min, diurnal (each model's peak at its own hour) with bursts (x2.5 for
an hour on a few models), scaled so the fleet's peak is ~65% busy under the static placement.

Strategies, each scored on the same windows:
* ``static``: today's zml.toml: every node on all day, nodes split among models by peak demand;
* ``cheapest_family`` / ``fastest_family``: the planner re-planning every window on the nodes of
  the family with the lowest price / highest speed only;
* ``planner``: the planner re-planning every window on the *last* window's demand (what it has
  measured), moves make before break (a model gaining replicas keeps its old capacity for the
  load time);
* ``hindsight``: the planner on each window's actual demand, no move cost, no load time: the
  offline optimum the issue compares against.

Measures (fluid model: a model's requests are served within SLO up to its SLO capacity at
saturation, the planner planning at ``headroom`` 0.8 of it): SLO attainment (served / asked,
requests), $ per 1M tokens served, and adapter requests whose adapter is loaded on a node of its
base. Not a per-request simulation: the router's choose_node is not run per request here.

    python benches/placement_day.py --nodes 104 --seeds 11 12 13
    python benches/placement_day.py --nodes 1000 --windows 48 --seeds 11
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass

from zmlcore.fleet.accelerators import ACCELERATORS, BASE_DECODE_TPS, BASE_PREFILL_TPS
from zmlcore.placement import AdapterDemand, ModelDemand, NodeOffer, PlanParams, evaluate, plan, slo_capacity

MIX = [("nvidia_h100", 4), ("amd_mi300x", 4), ("nvidia_a100", 2), ("intel_gaudi2", 2), ("aws_inferentia2", 1)]
SIZES = [(1.0, 16.0), (0.5, 32.0), (0.25, 70.0)]

TTFT_S = 2.0
HEADROOM = 0.8
#: The sum of the models' peaks as a share of the fleet's capacity for the average model.
LOAD = 0.3


@dataclass(frozen=True)
class Model:
    name: str
    speed: float
    memory: float
    prompt: float
    output: float
    peak: float
    peak_hour: float


def fleet(n_nodes: int) -> list[tuple[str, str]]:
    per = sum(k for _, k in MIX)
    out = []
    for i in range(n_nodes):
        j = i % per
        for acc, k in MIX:
            if j < k:
                out.append((f"{acc}-{i}", acc))
                break
            j -= k
    return out


def capacity(acc: str, m: Model, headroom: float) -> float:
    a = ACCELERATORS[acc]
    if m.memory > a.memory_gib:
        return 0.0
    return slo_capacity(prefill_tps=BASE_PREFILL_TPS * a.speed * m.speed, decode_tps=BASE_DECODE_TPS * a.speed * m.speed,
                        max_concurrency=a.max_concurrency, mean_prompt=m.prompt, mean_output=m.output, ttft_s=TTFT_S,
                        headroom=headroom)


def workload(seed: int, nodes: list[tuple[str, str]], n_windows: int):
    rng = random.Random(seed)
    models = []
    for i in range(20):
        speed, mem = SIZES[i % 3]
        models.append(Model(f"model-{i:02d}", speed, mem, prompt=rng.choice([256, 512, 1024, 2048, 4096]),
                            output=rng.choice([64, 128, 256, 512]), peak=rng.lognormvariate(0.0, 0.6),
                            peak_hour=rng.uniform(0, 24)))
    # scale: the sum of the models' peaks = LOAD of the fleet's capacity for the average model
    total_cap = sum(sum(capacity(acc, m, 1.0) for _, acc in nodes) for m in models) / len(models)
    scale = LOAD * total_cap / sum(m.peak for m in models)
    models = [Model(m.name, m.speed, m.memory, m.prompt, m.output, m.peak * scale, m.peak_hour) for m in models]
    bursts = {(rng.randrange(20), rng.randrange(n_windows)) for _ in range(6)}
    demand = []
    for w in range(n_windows):
        hour = w * 24 / n_windows
        row = {}
        for i, m in enumerate(models):
            diurnal = 0.25 + 0.75 * (1 + math.cos(2 * math.pi * (hour - m.peak_hour) / 24)) / 2
            burst = 2.5 if any((i, b) in bursts for b in range(w - 3, w + 1)) else 1.0
            row[m.name] = m.peak * diurnal * burst * rng.uniform(0.9, 1.1)
        demand.append(row)
    zipf = [1 / (k + 1) for k in range(100)]
    adapters = [(f"adapter-{k:03d}", models[k % 20].name, zipf[k] / sum(zipf)) for k in range(100)]
    return models, demand, adapters


def offers(nodes, models, held: dict[str, frozenset[str]], families: set[str] | None, headroom: float,
           held_ad: dict[str, frozenset[str]]) -> list[NodeOffer]:
    out = []
    for nid, acc in nodes:
        a = ACCELERATORS[acc]
        if families is not None and a.family not in families:
            continue
        caps = {m.name: capacity(acc, m, headroom) for m in models}
        out.append(NodeOffer(nid, a.family, a.cost_per_hour, {k: v for k, v in caps.items() if v > 0},
                             adapter_slots=8, models=held.get(nid, frozenset()), adapters=held_ad.get(nid, frozenset())))
    return out


def adapter_demand(adapters, row, adapter_share: float) -> tuple[dict[str, float], list[AdapterDemand]]:
    base = {m: r * (1 - adapter_share) for m, r in row.items()}
    ads = []
    per_base: dict[str, float] = {}
    for _, b, z in adapters:
        per_base[b] = per_base.get(b, 0.0) + z
    for name, b, z in adapters:
        ads.append(AdapterDemand(name, b, row[b] * adapter_share * z / per_base[b]))
    return base, ads


def static_placement(nodes, models, peak: dict[str, float]) -> dict[str, frozenset[str]]:
    """Nodes split among models by peak demand (each model at least one node it fits on)."""
    placed: dict[str, frozenset[str]] = {}
    need = {m.name: peak[m.name] for m in models}
    by_model = {m.name: m for m in models}
    for nid, acc in sorted(nodes, key=lambda n: -ACCELERATORS[n[1]].memory_gib):
        # the model furthest below its share of capacity that fits here
        best = max((m for m in need if capacity(acc, by_model[m], 1.0) > 0), key=lambda m: need[m], default=None)
        if best is None:
            continue
        placed[nid] = frozenset({best})
        need[best] -= capacity(acc, by_model[best], HEADROOM)
    return placed


def score(nodes_by_id, models, placed, row, window_h, prev_cap=None, load_frac=0.0):
    """(cost $ for the window, requests asked, requests served within SLO, tokens served)."""
    caps: dict[str, float] = {}
    cost = 0.0
    for nid, ms in placed.items():
        if not ms:
            continue
        cost += ACCELERATORS[nodes_by_id[nid]].cost_per_hour * window_h
        for m in ms:
            caps[m] = caps.get(m, 0.0) + capacity(nodes_by_id[nid], models[m], 1.0) / len(ms)
    asked = served = tokens = 0.0
    for m, r in row.items():
        cap = caps.get(m, 0.0)
        if prev_cap is not None and prev_cap.get(m, 0.0) < cap:  # new replicas load first
            cap = load_frac * prev_cap.get(m, 0.0) + (1 - load_frac) * cap
        s = min(r, cap)
        asked += r
        served += s
        tokens += s * (models[m].prompt + models[m].output)
    secs = window_h * 3600
    return cost, asked * secs, served * secs, tokens * secs, caps


def run(seed: int, n_nodes: int, n_windows: int) -> dict[str, dict[str, float]]:
    nodes = fleet(n_nodes)
    nodes_by_id = dict(nodes)
    models, demand, adapters = workload(seed, nodes, n_windows)
    mods = {m.name: m for m in models}
    peak = {m: max(row[m] for row in demand) for m in mods}
    fams = {ACCELERATORS[a].family: ACCELERATORS[a] for _, a in nodes}
    cheapest = min(fams, key=lambda f: fams[f].cost_per_hour)
    fastest = max(fams, key=lambda f: fams[f].speed)
    results: dict[str, dict[str, float]] = {}
    window_h = 24 / n_windows
    static = static_placement(nodes, models, peak)
    strategies = {"static": None, "planner": None, "hindsight": None, f"cheapest_family ({cheapest})": {cheapest},
                  f"fastest_family ({fastest})": {fastest}}
    for name in strategies:
        held: dict[str, frozenset[str]] = dict(static)
        held_ad: dict[str, frozenset[str]] = {}
        prev_cap: dict[str, float] | None = None
        tot = {"cost": 0.0, "asked": 0.0, "served": 0.0, "tokens": 0.0, "moves": 0, "plan_s": 0.0, "plans": 0,
               "ad_asked": 0.0, "ad_loaded": 0.0, "served_instant": 0.0}
        for w, row in enumerate(demand):
            if name == "static":
                placed = static
                load_frac = 0.0
            else:
                seen = row if name != "planner" or w == 0 else demand[w - 1]
                base, ads = adapter_demand(adapters, seen, 0.3)
                params = PlanParams(move_cost_per_h=0.0 if name == "hindsight" else 0.25)
                fam = strategies[name]
                t0 = time.process_time()
                p = plan(offers(nodes, models, held, fam, HEADROOM, held_ad),
                         [ModelDemand(m, r) for m, r in base.items()], ads, params)
                tot["plan_s"] += time.process_time() - t0
                tot["plans"] += 1
                placed = {n: ms for n, ms in p.models.items() if ms}
                moved = sum(len(placed.get(n, frozenset()) ^ held.get(n, frozenset())) for n in set(placed) | set(held))
                tot["moves"] += moved
                # adapters asked this window whose adapter is on a node of the plan
                _, actual_ads = adapter_demand(adapters, row, 0.3)
                for a in actual_ads:
                    tot["ad_asked"] += a.rate
                    if any(a.adapter in p.adapters.get(n, ()) for n in p.nodes_of(a.base)):
                        tot["ad_loaded"] += a.rate
                held, held_ad = placed, {n: a for n, a in p.adapters.items() if a}
                load_frac = 0.0 if name == "hindsight" else ACCELERATORS["amd_mi300x"].load_time_s * 2 / (window_h * 3600)
            cost, asked, served, tokens, caps = score(nodes_by_id, mods, placed, row, window_h, prev_cap, load_frac)
            # the same window as if every move were instant: what the moves themselves cost in SLO
            tot["served_instant"] += score(nodes_by_id, mods, placed, row, window_h)[2]
            prev_cap = caps
            tot["cost"] += cost
            tot["asked"] += asked
            tot["served"] += served
            tot["tokens"] += tokens
        results[name] = {
            "cost_usd": round(tot["cost"], 2),
            "slo_attainment": round(tot["served"] / tot["asked"], 5),
            "slo_attainment_instant_moves": round(tot["served_instant"] / tot["asked"], 5),
            "usd_per_1m_tokens": round(tot["cost"] / (tot["tokens"] / 1e6), 5),
            "moves": tot["moves"],
            "plan_cpu_s_mean": round(tot["plan_s"] / tot["plans"], 4) if tot["plans"] else 0.0,
            "adapter_loaded_share": round(tot["ad_loaded"] / tot["ad_asked"], 4) if tot["ad_asked"] else 0.0,
        }
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=104)
    ap.add_argument("--windows", type=int, default=96)
    ap.add_argument("--seeds", type=int, nargs="+", default=[11])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    out = {}
    for seed in args.seeds:
        res = run(seed, args.nodes, args.windows)
        out[str(seed)] = res
        st, pl, hs = res["static"], res["planner"], res["hindsight"]
        print(f"seed {seed}, {args.nodes} nodes, {args.windows} windows:")
        for name, r in res.items():
            print(f"  {name:<28} ${r['cost_usd']:>9.2f}  SLO {r['slo_attainment']:7.2%}  "
                  f"${r['usd_per_1m_tokens']:.4f}/1M tok  moves {r['moves']:>5}  plan {r['plan_cpu_s_mean'] * 1000:6.1f} ms"
                  + (f"  adapters loaded {r['adapter_loaded_share']:.1%}" if r["adapter_loaded_share"] else ""))
        print(f"  planner SLO with moves' load time {pl['slo_attainment']:.2%}, moves instant "
              f"{pl['slo_attainment_instant_moves']:.2%}")
        print(f"  planner vs static: {1 - pl['usd_per_1m_tokens'] / st['usd_per_1m_tokens']:.1%} lower $/1M tokens; "
              f"vs hindsight: {pl['usd_per_1m_tokens'] / hs['usd_per_1m_tokens'] - 1:+.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
