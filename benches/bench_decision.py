"""Decision time of zmlcore.policy.choose_node: fleets of 10 to 10,000 nodes x chains of 1-5 families.

    python benches/bench_decision.py            # prints markdown tables (median / p99 in us)
    python benches/bench_decision.py --quick    # fewer iterations

The fleet cycles through the five accelerator types (one family each, list speeds, so five
index classes); every node starts with random load. Each timed decision is followed, untimed,
by what the router does next: the chosen node's outstanding/pending +1 and one random node's
-1 (so the index is exercised the way it is in production). The second table times the same
counter update (the FleetIndex hook) and a full FleetIndex rebuild.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import statistics
import time

from zmlcore.accelerators import ACCELERATORS
from zmlcore.config import PolicyConfig
from zmlcore.messages import NodeState
from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy.resolve import ResolvedPolicy

TYPES = list(ACCELERATORS)
FAMILIES = [ACCELERATORS[t].family for t in TYPES]


def make_fleet(n: int, rng: random.Random) -> list[NodeView]:
    views = []
    for i in range(n):
        t = TYPES[i % len(TYPES)]
        a = ACCELERATORS[t]
        st = NodeState(
            node_id=f"n{i}", accelerator_type=t, family=a.family, endpoint=f"http://n{i}:8000", status="up",
            models=["m"], queue_running=rng.randint(0, a.max_concurrency), queue_waiting=rng.randint(0, 3),
            max_concurrency=a.max_concurrency, cost_per_hour=a.cost_per_hour, health_score=100.0, updated_at=1000.0,
        )
        v = NodeView(st, outstanding=rng.randint(0, 40), pending=rng.randint(0, 4))
        views.append(v)
    return views


def chain_policy(k: int, prio: str = "balanced") -> ResolvedPolicy:
    chain = FAMILIES[:k]
    return ResolvedPolicy(f"chain{k}", PolicyConfig(accelerator_chain=chain, cost_priority=prio), tuple(chain))  # type: ignore[arg-type]


def time_decisions(fleet: FleetIndex, pol: ResolvedPolicy, iters: int, rng: random.Random) -> tuple[float, float]:
    state = RoutingState()
    views = list(fleet)
    samples = []
    now = 1000.0
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for it in range(iters + 200):
            req = RouteRequest(model="m", prompt_tokens=rng.randint(50, 3000))
            t0 = clock()
            d = choose_node(fleet, req, pol, now, state)
            t1 = clock()
            if it >= 200:
                samples.append((t1 - t0) / 1000.0)
            v = fleet.get(d.node_id)
            assert v is not None
            v.outstanding += 1
            v.pending += 1
            w = views[rng.randrange(len(views))]
            if w.outstanding > 0:
                w.outstanding -= 1
            if w.pending > 0:
                w.pending -= 1
            now += 0.001
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="10,100,1000,10000")
    args = ap.parse_args()
    iters = 1000 if args.quick else 5000
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"# choose_node decision time (us), Python {platform.python_version()}, {iters} decisions per cell\n")
    print("Policy chain with cost_priority=balanced (the account default's evaluation), median / p99:\n")
    print("| nodes | " + " | ".join(f"chain of {k}" for k in range(1, 6)) + " |")
    print("|---|" + "---|" * 5)
    for n in sizes:
        rng = random.Random(n)
        fleet = FleetIndex(make_fleet(n, rng))
        cells = []
        for k in range(1, 6):
            med, p99 = time_decisions(fleet, chain_policy(k), iters, rng)
            cells.append(f"{med:.1f} / {p99:.1f}")
        print(f"| {n:,} | " + " | ".join(cells) + " |")
    print("\nEach strategy over all 5 families, median / p99:\n")
    names = ["latency", "cost", "availability", "round_robin", "balanced"]
    weighted = ResolvedPolicy("weighted", PolicyConfig(strategy="weighted", latency_weight=0.7, cost_weight=0.3, queue_threshold=24), ())
    chain_lat = chain_policy(5, "latency")
    chain_cost = chain_policy(5, "cost")
    pols = [builtin_policy(x) for x in names] + [weighted, chain_lat, chain_cost]
    labels = names + ["weighted", "chain/latency", "chain/cost"]
    print("| nodes | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for n in sizes:
        rng = random.Random(n + 1)
        fleet = FleetIndex(make_fleet(n, rng))
        cells = []
        for pol in pols:
            med, p99 = time_decisions(fleet, pol, iters // 2, rng)
            cells.append(f"{med:.1f} / {p99:.1f}")
        print(f"| {n:,} | " + " | ".join(cells) + " |")
    print("\nIndex upkeep (us): one counter change (`view.outstanding += 1`), and a full rebuild of the model table "
          "(after a node joins, leaves or changes models/speeds); plain list = choose_node on a list (index built per call):\n")
    print("| nodes | counter update | rebuild | plain list, latency |")
    print("|---|---|---|---|")
    for n in sizes:
        rng = random.Random(n + 2)
        views = make_fleet(n, rng)
        fleet = FleetIndex(views)
        choose_node(fleet, RouteRequest(model="m"), builtin_policy("latency"), 1000.0, RoutingState())
        t0 = time.perf_counter_ns()
        for i in range(2000):
            views[i % n].outstanding += 1
        upd = (time.perf_counter_ns() - t0) / 2000 / 1000
        reps = max(3, 2000 // n)
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fleet._invalidate()
            fleet.table("m")
        reb = (time.perf_counter_ns() - t0) / reps / 1000
        reps = max(3, 1000 // n)
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            choose_node(views, RouteRequest(model="m"), builtin_policy("latency"), 1000.0, RoutingState())
        plain = (time.perf_counter_ns() - t0) / reps / 1000
        print(f"| {n:,} | {upd:.2f} | {reb:,.0f} | {plain:,.0f} |")


if __name__ == "__main__":
    main()
