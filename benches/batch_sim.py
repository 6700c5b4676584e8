"""The Batch API on the reference fleet in virtual time: interactive traffic with and without a
batch running beside it, routed and gated by the code that ships.

    python benches/batch_sim.py                                   # seeds 1-3, the demo's policies
    python benches/batch_sim.py --seeds 3 --first-seed 1001 --reserves 0.1,0.25,0.4   # tuning seeds
    python benches/batch_sim.py --save benches/batch_sim_results.json

The fleet, node dynamics and router bookkeeping are the routing simulator's (benches/routing_sim.py,
routing_simnode.py, routing_simrouter.py: 2xH100, A100, 2xMI300X, Gaudi2, Inferentia2, the live
sim's SimProfile model, a 5 s poll, the router's own outstanding/pending counters, half the
interactive requests streamed). Interactive requests: Poisson at ``--load`` x the fleet's
capacity, the reference's lognormal lengths, routed by ``zmlcore.policy.choose_node`` with the
demo's model policy (``llama3-production``: balanced over H100, MI300X, A100, Gaudi2, 500 ms)
and the admission bound. The batch: one runner with ``zml_batch.gate.Gate`` (the window it learns
from the router's refusals: accepted when not refused within ACCEPT_S, backoff on refusal, a
slot freed at each end), each line decided by ``zmlcore.policy.headroom.admit_batch`` with the
runner's built-in batch policy (cost, 10 s target) and ``--reserves`` as ``[router]
batch_reserve``; the same lengths as the interactive requests, never streamed.

Each (seed, reserve) runs the same interactive trace twice, without and with the batch, and
reports: interactive TTFT p50/p99 and their ratio; the batch's lines completed per second against
the spare capacity (capacity minus the interactive requests served per second); the share of the
batch's tokens on each family and on the cheapest families that could carry the batch: families
in order of cost per unit of capacity, as few as carry the spare capacity (by their whole
capacity, and by the capacity interactive traffic left them).

Parameters were chosen on seeds 1001-1003 (``[router] batch_reserve`` 0.1: the only value of
0, 0.1, 0.15, 0.2, 0.25, 0.4 whose TTFT and spare-capacity medians both met the targets);
docs/benchmarks.md reports seeds 1-3.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "services" / "batch" / "src")]
from routing_sim import FLEET, MEAN_O, MEAN_P, MODEL, _family, _state, capacity_rps, make_requests, make_trace  # noqa: E402
from routing_simnode import EPS, SimNode  # noqa: E402
from routing_simrouter import DELTA, EXPIRE, SimRouters  # noqa: E402
from zml_batch.gate import ACCEPT_S, Gate  # noqa: E402

from zmlcore.config import PolicyConfig, RouterConfig  # noqa: E402
from zmlcore.errors import NoHealthyNodesError, QueueFullError  # noqa: E402
from zmlcore.fleet.perfmodel import SimProfile  # noqa: E402
from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState, builtin_policy, choose_node  # noqa: E402
from zmlcore.policy.estimate import NONSTREAM_PENDING_FOR, prompt_tokens_from_body  # noqa: E402
from zmlcore.policy.headroom import admit_batch  # noqa: E402
from zmlcore.policy.resolve import make_policy  # noqa: E402

PREFILL, DECODE, POLL = 0, 1, 2  # DELTA, EXPIRE = 3, 4 (routing_simrouter)
TRY, ACCEPTED = 5, 6
#: A NATS round trip runner -> router -> runner (a refusal's way back).
RTT_S = 0.002
FAMILIES = ["H100", "MI300X", "A100", "Gaudi2", "Inferentia2"]
INTERACTIVE = make_policy("llama3-production", PolicyConfig(accelerator_chain=["H100", "MI300X", "A100", "Gaudi2"],
                                                           latency_target_ms=500, cost_priority="balanced"),
                          FAMILIES)
BATCH = make_policy("batch", PolicyConfig(strategy="cost", latency_target_ms=10_000), FAMILIES)
WINDOW_CEILING = 256  # [batch] max_in_flight


def family_order() -> list[tuple[str, float, float]]:
    """(family, cost per unit of capacity, capacity req/s), cheapest first."""
    out: dict[str, list[float]] = {}
    for _, t in FLEET:
        prof = SimProfile.for_type(t)
        cap = prof.capacity_rps(MEAN_P, MEAN_O)
        fam = _family(SimNode(0, "x", prof))
        entry = out.setdefault(fam, [prof.cost_per_hour / cap, 0.0])
        entry[1] += cap
    return sorted(((f, c, cap) for f, (c, cap) in out.items()), key=lambda x: x[1])


def run(seed: int, n: int, load: float, reserve: float, batch: bool, interactive: str = "demo") -> dict[str, Any]:
    cap = capacity_rps()
    arr, P, O = make_trace(n, load * cap, False, seed)
    body, streamed = make_requests(P, seed, 0.5)
    est_p = [prompt_tokens_from_body(b) for b in body]
    # The batch's lines: the same length distributions, their own draw; as many as could run.
    m = n * 2 if batch else 0
    _, BP, BO = make_trace(max(m, 1), 1.0, False, seed + 500_000)
    bbody, _ = make_requests(BP, seed + 500_000, 0.0)
    P, O = P + BP[:m], O + BO[:m]
    est_p += [prompt_tokens_from_body(b) for b in bbody[:m]]
    streamed = streamed + [False] * m
    total = n + m
    warm = n // 10
    tw, te = arr[warm], arr[-1]
    rnd = random.Random(seed * 7919 + 1)
    nodes = [SimNode(i, name, SimProfile.for_type(t)) for i, (name, t) in enumerate(FLEET)]
    views = [NodeView(_state(nd, 0.0)) for nd in nodes]
    fleet = FleetIndex(views)
    rstate = RoutingState()
    routers = SimRouters([views], total, share=True, local=True, count_pending=True, expiry=NONSTREAM_PENDING_FOR,
                         seed=seed * 7919 + 2)
    bound = RouterConfig().admission_ttft_s
    ttft = [math.nan] * n
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0

    def push(t: float, k: int, a: int, b: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, k, a, b))

    for nd in nodes:
        push(rnd.uniform(0, 5.0), POLL, 0, nd.idx)
    gate = Gate(WINDOW_CEILING)
    next_line = n
    batch_done = 0
    batch_tokens: dict[str, int] = {}
    inter_by_family: dict[str, int] = {}
    served_in_window = 0
    refusals = 0

    def start_prefill(nd: SimNode, now: float) -> None:
        nd.advance(now)
        if nd.prefq:
            r = nd.prefq.popleft()
            nd.prefq_tok -= P[r]
            nd.cur = r
            nd.cur_end = now + P[r] / nd.pf
            nd.ver += 1
            push(nd.cur_end, PREFILL, nd.idx, 0)
        else:
            nd.ver += 1
            if nd.decoding:
                push(now + (nd.decoding[0][0] - nd.vt) * nd.step(len(nd.decoding)), DECODE, nd.idx, nd.ver)

    def arrive(nd: SimNode, r: int, now: float) -> None:
        nd.advance(now)
        nd.outstanding += 1
        if nd.admitted < nd.maxc:
            nd.admitted += 1
            nd.prefq.append(r)
            nd.prefq_tok += P[r]
        else:
            nd.waitq.append(r)
            nd.waitq_tok += P[r]
        if nd.cur < 0:
            start_prefill(nd, now)

    def complete(nd: SimNode, r: int, now: float) -> None:
        nonlocal batch_done, served_in_window
        nd.admitted -= 1
        nd.outstanding -= 1
        if nd.waitq:
            r2 = nd.waitq.popleft()
            nd.waitq_tok -= P[r2]
            nd.admitted += 1
            nd.prefq.append(r2)
            nd.prefq_tok += P[r2]
        routers.complete(r, now, push)
        if r >= n:
            gate.ended(now)
            push(now, TRY, 0, 0)
            if tw <= now <= te:
                batch_done += 1
                fam = _family(nd)
                batch_tokens[fam] = batch_tokens.get(fam, 0) + P[r] + O[r]
        elif tw <= now <= te:
            served_in_window += 1
            fam = _family(nd)
            inter_by_family[fam] = inter_by_family.get(fam, 0) + 1

    def try_batch(now: float) -> None:
        nonlocal next_line, refusals
        while next_line < total and gate.may_send(now):
            r = next_line
            rr = RouteRequest(model=MODEL, prompt_tokens=est_p[r])
            gate.sent()
            try:
                d = admit_batch(fleet, rr, BATCH, now, rstate, stale_after_s=15.0, reserve=reserve)
            except (QueueFullError, NoHealthyNodesError) as exc:
                refusals += 1
                gate.refused(now + RTT_S, exc.retry_after)
                push(gate.blocked_until, TRY, 0, 0)
                return
            next_line += 1
            nd = nodes[_index[d.node_id]]
            routers.dispatch(r, 0, nd.idx, False, d.estimated_ttft_s, now, push)
            arrive(nd, r, now)
            push(now + ACCEPT_S, ACCEPTED, 0, 0)

    if batch:
        push(arr[0], TRY, 0, 0)
    k = 0
    inter_done = 0
    while inter_done < n:
        next_arr = arr[k] if k < n else math.inf
        if heap and heap[0][0] < next_arr:
            now, _, ev, a, b = heapq.heappop(heap)
            if ev == EXPIRE:
                routers.expire(a, now, push)
            elif ev == DELTA:
                routers.deliver(a, b)
            elif ev == POLL:
                views[b].state = _state(nodes[b], now)
                push(now + 5.0 * rnd.uniform(0.8, 1.2), POLL, 0, b)
            elif ev == TRY:
                try_batch(now)
            elif ev == ACCEPTED:
                gate.accepted()
                try_batch(now)
            else:
                nd = nodes[a]
                if ev == PREFILL:
                    r = nd.cur
                    nd.cur = -1
                    nd.last_t = now
                    if r < n:
                        ttft[r] = now - arr[r]
                    routers.first_token(r, streamed[r], now, push)
                    if O[r] - 1 > 0:
                        heapq.heappush(nd.decoding, (nd.vt + O[r] - 1, r))
                    else:
                        complete(nd, r, now)
                        inter_done += r < n
                    start_prefill(nd, now)
                elif ev == DECODE and b == nd.ver:
                    nd.vt = nd.decoding[0][0]
                    nd.last_t = now
                    while nd.decoding and nd.decoding[0][0] <= nd.vt + EPS:
                        _, r = heapq.heappop(nd.decoding)
                        complete(nd, r, now)
                        inter_done += r < n
                    start_prefill(nd, now)
            continue
        r = k
        k += 1
        now = arr[r]
        rr = RouteRequest(model=MODEL, prompt_tokens=est_p[r])
        try:
            d = choose_node(fleet, rr, INTERACTIVE if interactive == "demo" else builtin_policy(interactive), now, rstate)
            if d.estimated_ttft_s > bound:
                d = choose_node(fleet, rr, builtin_policy("latency"), now, rstate)
        except (QueueFullError, NoHealthyNodesError):
            inter_done += 1
            continue
        if d.estimated_ttft_s > bound:
            inter_done += 1
            continue
        nd = nodes[_index[d.node_id]]
        routers.dispatch(r, 0, nd.idx, streamed[r], d.estimated_ttft_s, now, push)
        arrive(nd, r, now)
    meas = np.array([t for t in ttft[warm:] if not math.isnan(t)])
    window = te - tw
    served = served_in_window / window
    spare = cap - served
    out = {"seed": seed, "load": load, "reserve": reserve, "batch": batch, "n": n,
           "p50": float(np.percentile(meas, 50)), "p99": float(np.percentile(meas, 99)), "served_rps": served,
           "spare_rps": spare, "batch_rps": batch_done / window, "batch_refusals": refusals}
    if batch:
        total_t = sum(batch_tokens.values()) or 1
        out["spare_used"] = out["batch_rps"] / spare
        out["tokens_by_family"] = {f: batch_tokens.get(f, 0) / total_t for f in FAMILIES}
        carry, cheap = 0.0, []
        for fam, _cost, fcap in family_order():
            cheap.append(fam)
            carry += fcap
            if carry >= spare:
                break
        out["cheapest"] = cheap
        out["cheapest_share"] = sum(out["tokens_by_family"][f] for f in cheap)
        # The same, counting only each family's spare capacity (what interactive traffic left it):
        # would a cheaper family have had room for what the batch put on a dearer one?
        carry, cheap_spare = 0.0, []
        for fam, _cost, fcap in family_order():
            cheap_spare.append(fam)
            carry += max(0.0, fcap - inter_by_family.get(fam, 0) / window)
            if carry >= out["batch_rps"]:
                break
        out["cheapest_with_room"] = cheap_spare
        out["cheapest_with_room_share"] = sum(out["tokens_by_family"][f] for f in cheap_spare)
    return out


_index = {name: i for i, (name, _t) in enumerate(FLEET)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000, help="interactive requests per run")
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--reserves", default="0.25", help="[router] batch_reserve values, comma-separated")
    ap.add_argument("--interactive", default="demo", help="the interactive requests' policy: demo "
                    "(llama3-production) or a built-in name (latency, balanced, cost...)")
    ap.add_argument("--save", default=None)
    args = ap.parse_args(argv)
    results = []
    for reserve in [float(x) for x in args.reserves.split(",")]:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            base = run(seed, args.requests, args.load, reserve, False, args.interactive)
            with_b = run(seed, args.requests, args.load, reserve, True, args.interactive)
            row = {"seed": seed, "reserve": reserve, "load": args.load, "interactive": args.interactive,
                   "alone": base, "with_batch": with_b,
                   "p99_ratio": with_b["p99"] / base["p99"], "p50_ratio": with_b["p50"] / base["p50"]}
            results.append(row)
            print(json.dumps({"seed": seed, "reserve": reserve, "p99_alone": round(base["p99"], 4),
                              "p99_with": round(with_b["p99"], 4), "p99_ratio": round(row["p99_ratio"], 3),
                              "spare_used": round(with_b["spare_used"], 3),
                              "cheapest": with_b["cheapest"], "cheapest_share": round(with_b["cheapest_share"], 3),
                              "cheapest_with_room": with_b["cheapest_with_room"],
                              "cheapest_with_room_share": round(with_b["cheapest_with_room_share"], 3),
                              "tokens": {k: round(v, 3) for k, v in with_b["tokens_by_family"].items()},
                              "batch_rps": round(with_b["batch_rps"], 3), "spare_rps": round(with_b["spare_rps"], 3)}),
                  flush=True)
    for reserve in sorted({r["reserve"] for r in results}):
        rows = [r for r in results if r["reserve"] == reserve]
        print(f"reserve {reserve}: median p99 ratio {statistics.median(r['p99_ratio'] for r in rows):.3f}, "
              f"spare used {statistics.median(r['with_batch']['spare_used'] for r in rows):.3f}, "
              f"cheapest-family share {statistics.median(r['with_batch']['cheapest_share'] for r in rows):.3f} "
              f"(of the cheapest with room: {statistics.median(r['with_batch']['cheapest_with_room_share'] for r in rows):.3f})")
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
