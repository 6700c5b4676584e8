"""Decision time of zmlcore.policy.choose_node at 100 / 1,000 / 10,000 nodes, index upkeep included.

    python benches/bench_decision.py                 # markdown tables (median / p99 / mean, us)
    python benches/bench_decision.py --quick         # fewer decisions per cell
    python benches/bench_decision.py --small         # 1-64 nodes, Python scan vs numpy rows
    python benches/bench_decision.py --cache         # with the prefix index: 1,000 nodes, 8k-token
                                                     # prompts, up to 1 M index entries (what the
                                                     # nodes' KV capacity holds), and its memory
    python benches/bench_decision.py --cache --keys-from gateway
                                                     # the same behind the gateway: the prompt's
                                                     # keys come in a header (Zml-Prefix-Keys)

The fleet is what a router sees: five accelerator types, and every node with its *own*
measured speeds (health's EWMA over noisy per-request observations of a true speed that
differs per node and wanders over time), so no two nodes score alike. Time runs virtually:
decisions arrive at ``--rate`` per second and every node is polled every ``--poll-interval``
seconds (+-10% jitter, phases spread like the health service's). Each timed unit is one
decision plus all index upkeep since the previous one: the polled states that arrived
(``view.state = new_state``, the router's KV handler) and the counter changes of the previous
dispatch and of completions (``view.outstanding += 1`` ...). Building the new NodeState (the
router's KV decode) is not index work and is not timed. GC stays on. Besides wall-clock time
each unit's thread CPU time is reported: on a shared box it leaves out the time the process
waited for a core (wall-clock p99s there are mostly other processes' time slices).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import os
import platform
import random
import statistics
import time
from typing import Any

import msgspec

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.config import PolicyConfig
from zmlcore.messages import NodeState
from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState, builtin_policy, choose_node
from zmlcore.policy import fleet as fleet_module
from zmlcore.policy.estimate import node_speeds
from zmlcore.policy.resolve import ResolvedPolicy

TYPES = list(ACCELERATORS)
FAMILIES = [ACCELERATORS[t].family for t in TYPES]
#: Per-node spread of true speeds around the type's list speed (lognormal sigma), the drift of
#: a true speed per poll (random walk sigma), the noise of one observation and the EWMA weight.
NODE_SPREAD, DRIFT, NOISE, ALPHA = 0.08, 0.01, 0.05, 0.2


class Node:
    """A node's true speeds and the health service's EWMA of them."""

    __slots__ = ("view", "true_pf", "true_dec", "pf", "dec", "maxc")

    def __init__(self, view: NodeView, rng: random.Random) -> None:
        self.view = view
        pf, dec, self.maxc = node_speeds(view.state)
        self.true_pf = pf * rng.lognormvariate(0, NODE_SPREAD)
        self.true_dec = dec * rng.lognormvariate(0, NODE_SPREAD)
        self.pf, self.dec = self.true_pf, self.true_dec

    def poll(self, rng: random.Random, now: float) -> NodeState:
        self.true_pf *= math.exp(rng.gauss(0, DRIFT))
        self.true_dec *= math.exp(rng.gauss(0, DRIFT))
        self.pf += ALPHA * (self.true_pf * (1 + rng.gauss(0, NOISE)) - self.pf)
        self.dec += ALPHA * (self.true_dec * (1 + rng.gauss(0, NOISE)) - self.dec)
        v = self.view
        return msgspec.structs.replace(
            v.state, prefill_tps=round(self.pf, 3), decode_tps=round(self.dec, 3), updated_at=now,
            queue_running=min(self.maxc, v.outstanding + rng.randint(0, 2)), queue_waiting=rng.randint(0, 2),
            health_score=round(rng.uniform(90, 100), 1),
        )


def make_fleet(n: int, rng: random.Random) -> list[Node]:
    nodes = []
    for i in range(n):
        t = TYPES[i % len(TYPES)]
        a = ACCELERATORS[t]
        st = NodeState(
            node_id=f"n{i}", accelerator_type=t, family=a.family, endpoint=f"http://n{i}:8000", status="up",
            models=["m"], max_concurrency=a.max_concurrency, cost_per_hour=a.cost_per_hour, health_score=100.0,
            updated_at=0.0,
        )
        node = Node(NodeView(st, outstanding=rng.randint(0, 40), pending=rng.randint(0, 4)), rng)
        node.view.state = node.poll(rng, 0.0)
        nodes.append(node)
    return nodes


def chain_policy(k: int, prio: str = "balanced") -> ResolvedPolicy:
    chain = FAMILIES[:k]
    return ResolvedPolicy(f"chain{k}", PolicyConfig(accelerator_chain=chain, cost_priority=prio), tuple(chain))  # type: ignore[arg-type]


def run_cell(n: int, pol: ResolvedPolicy, iters: int, rate: float, poll_s: float, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    nodes = make_fleet(n, rng)
    views = [nd.view for nd in nodes]
    fleet = FleetIndex(views)
    state = RoutingState()
    now = 1.0
    polls = [(now + rng.uniform(0, poll_s), i) for i in range(n)]
    heapq.heapify(polls)
    clock = time.perf_counter_ns
    cpu = time.thread_time_ns
    warm = 200
    units: list[float] = []
    cpu_units: list[float] = []
    decisions: list[float] = []
    poll_costs: list[float] = []
    n_polls = 0
    last = None
    choose_node(fleet, RouteRequest(model="m"), pol, now, state)  # build the table (not timed)
    rebuilds = getattr(fleet, "rebuilds", 0)
    gc.collect()
    for it in range(iters + warm):
        now += 1.0 / rate
        # Polls that arrived since the last decision: the new states are decoded off the clock.
        due = []
        while polls[0][0] <= now:
            t_due, i = heapq.heappop(polls)
            due.append((nodes[i].view, nodes[i].poll(rng, t_due)))
            heapq.heappush(polls, (t_due + poll_s * rng.uniform(0.9, 1.1), i))
        done = views[rng.randrange(n)]
        req = RouteRequest(model="m", prompt_tokens=rng.randint(50, 3000))
        c0 = cpu()
        t0 = clock()
        for v, st in due:
            p0 = clock()
            v.state = st
            poll_costs.append(clock() - p0)
        if last is not None:  # the previous dispatch, and one completion
            last.outstanding += 1
            last.pending += 1
        if done.outstanding > 0:
            done.outstanding -= 1
        if done.pending > 0:
            done.pending -= 1
        t2 = clock()
        d = choose_node(fleet, req, pol, now, state)
        t3 = clock()
        c3 = cpu()
        last = fleet.get(d.node_id)
        if it >= warm:
            units.append((t3 - t0) / 1000.0)
            cpu_units.append((c3 - c0) / 1000.0)
            decisions.append((t3 - t2) / 1000.0)
            n_polls += len(due)
    assert getattr(fleet, "rebuilds", 0) == rebuilds, "a poll forced a table rebuild"
    for xs in (units, cpu_units, decisions, poll_costs):
        xs.sort()
    return {
        "median": statistics.median(units), "p99": p99(units), "mean": statistics.fmean(units),
        "cpu_median": statistics.median(cpu_units), "cpu_p99": p99(cpu_units),
        "dec_median": statistics.median(decisions), "dec_p99": p99(decisions),
        "polls_per_decision": n_polls / iters,
        "poll_median": statistics.median(poll_costs) / 1000.0 if poll_costs else 0.0,
        "poll_p99": p99(poll_costs) / 1000.0 if poll_costs else 0.0,
    }


def small_cell(n: int, pol: ResolvedPolicy, small_table: int | None, reps: int = 5, k: int = 2000) -> float:
    """Thread CPU time (us) of one decision plus the two counter changes around it (this
    dispatch, a completion), as the router does them, on an ``n``-node fleet passed as the
    same list object every call (so choose_node keeps a watching index): the best of ``reps``
    runs of ``k``. On the path the index picks, or forced onto one (``small_table``:
    fleet.SMALL_TABLE)."""
    saved = getattr(fleet_module, "SMALL_TABLE", None)
    if small_table is not None:
        fleet_module.SMALL_TABLE = small_table
    try:
        rng = random.Random(n)
        views = [nd.view for nd in make_fleet(n, rng)]
        state = RoutingState()
        reqs = [RouteRequest(model="m", prompt_tokens=rng.randint(50, 3000)) for _ in range(k)]
        for r in reqs[:3]:
            choose_node(views, r, pol, 1.0, state)
        by_id = {v.node_id: v for v in views}
        times = []
        for _ in range(reps):
            t0 = time.thread_time_ns()
            for j, r in enumerate(reqs):
                by_id[choose_node(views, r, pol, 1.0, state).node_id].outstanding += 1
                w = views[j % n]
                if w.outstanding > 0:
                    w.outstanding -= 1
            times.append((time.thread_time_ns() - t0) / k / 1000.0)
        return min(times)
    finally:
        if saved is not None:
            fleet_module.SMALL_TABLE = saved


def small_fleets(pols: list[ResolvedPolicy], labels: list[str]) -> None:
    """Decision time on 1-64 nodes: as shipped, and (when the index has two paths) forced
    onto the Python scan and onto the numpy rows, which is how SMALL_TABLE was chosen."""
    threshold = getattr(fleet_module, "SMALL_TABLE", None)
    sizes = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    what = "as shipped" if threshold is None else f"as shipped (SMALL_TABLE = {threshold}) [Python scan / numpy rows]"
    print(f"Small fleets: one decision and its two counter changes, us of thread CPU time (best of 5 runs of "
          f"2,000), {what}:\n")
    print("| nodes | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for n in sizes:
        cells = []
        for pol in pols:
            cell = f"{small_cell(n, pol, None):.1f}"
            if threshold is not None:
                cell += f" [{small_cell(n, pol, 10**9):.1f} / {small_cell(n, pol, 0):.1f}]"
            cells.append(cell)
        print(f"| {n} | " + " | ".join(cells) + " |")
    print()


# --- with the prefix index (cache-aware routing) ---

#: Random text the conversations are cut from (ASCII, so one byte per character).
_TEXT = None


def _text(n: int, rng: random.Random) -> str:
    global _TEXT
    if _TEXT is None:
        words = [("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
                 for _ in range(5000)]
        _TEXT = " ".join(rng.choice(words) for _ in range(400_000))
    off = rng.randrange(0, len(_TEXT) - n)
    return _TEXT[off:off + n]


class Conversation:
    """A conversation on the fleet: a system prompt and turns, ~8k tokens (32 KB) of context."""

    __slots__ = ("messages", "node", "size")

    def __init__(self, system: str, rng: random.Random, context: int) -> None:
        self.messages = [{"role": "system", "content": system}]
        self.node = ""
        self.size = len(system)
        while self.size < context:
            self._add("user", rng.randint(200, 1200), rng)
            self._add("assistant", rng.randint(400, 2400), rng)

    def _add(self, role: str, n: int, rng: random.Random) -> None:
        self.messages.append({"role": role, "content": _text(n, rng)})
        self.size += n

    def turn(self, rng: random.Random, context: int) -> list[dict[str, str]]:
        """The next request: the conversation, the last reply and a new user message. Past
        ``context`` + 4 KB the conversation ends and a new one (a new chain) starts in its
        place: about one request in four carries a prompt no node holds beyond its system
        prompt, the rest extend a prompt their node holds."""
        if self.size > context + 4000:
            system = self.messages[0]["content"]
            self.__init__(system, rng, context)  # type: ignore[misc]
        else:
            if self.messages[-1]["role"] == "user":
                self._add("assistant", rng.randint(400, 2400), rng)
            self._add("user", rng.randint(200, 1200), rng)
        return list(self.messages)


def cache_cell(n: int, pol: ResolvedPolicy, iters: int, rate: float, poll_s: float, seed: int,
               entries: int, context: int, keys_from: str = "router") -> dict[str, float]:
    """One decision with the prefix index, as the router makes it, per timed unit: the prompt's
    keys (the router's ``prefix_chain``: for a request sent on ``zml.infer``, its raw messages
    decoded and keyed; ``keys_from="gateway"``: parsed from the ``Zml-Prefix-Keys`` header the
    gateway computed, whose own cost is reported apart as ``gateway_keys_median``),
    ``choose_node`` with the index, the dispatch's ``record``, the report of an earlier request
    (``correct``) and the polls and counter changes since the previous unit. The index is first
    filled to ``entries`` entries over the fleet (conversations recorded on their nodes,
    corrected as served)."""
    from zml_router.request.prepare import prefix_chain
    from zmlcore import subjects
    from zmlcore.messages.infer import infer_request_decoder
    from zmlcore.policy.prefix import PrefixIndex, chain_header, prompt_keys

    encode_request = msgspec.json.Encoder().encode

    rng = random.Random(seed)
    nodes = make_fleet(n, rng)
    views = [nd.view for nd in nodes]
    fleet = FleetIndex(views)
    # the bound counts a block per entry; long prompts' keys stand for several: room for ``entries``
    idx = PrefixIndex(max_entries=int(entries * 4))
    for v in views:
        idx.update_node(v.state)
    systems = [_text(rng.randint(2000, 8000), rng) for _ in range(20)]
    now = 1.0
    # the conversations the decisions extend, and other prompts until the index holds ``entries``
    convs = [Conversation(rng.choice(systems), rng, context) for _ in range(2000)]
    for c in convs:
        c.node = views[rng.randrange(n)].node_id
        kc = prompt_keys("m", messages=c.messages)
        idx.record(c.node, kc, now)
        idx.correct(c.node, kc, 0, now)
    fill_with(idx, [v.node_id for v in views], systems, entries, context, rng, now)
    state = RoutingState()
    polls = [(now + rng.uniform(0, poll_s), i) for i in range(n)]
    heapq.heapify(polls)
    clock = time.perf_counter_ns
    cpu = time.thread_time_ns
    warm = 200
    units: list[float] = []
    cpu_units: list[float] = []
    hashing: list[float] = []
    path: list[float] = []
    upkeep: list[float] = []
    gateway: list[float] = []
    inflight: list[tuple[str, Any, int]] = []
    warm_hits = 0
    last = None
    gc.collect()
    for it in range(iters + warm):
        now += 1.0 / rate
        due = []
        while polls[0][0] <= now:
            t_due, i = heapq.heappop(polls)
            due.append((nodes[i].view, nodes[i].poll(rng, t_due)))
            heapq.heappush(polls, (t_due + poll_s * rng.uniform(0.9, 1.1), i))
        conv = convs[min(len(convs) - 1, int(rng.paretovariate(1.2)) - 1)] if rng.random() < 0.5 else rng.choice(convs)
        msgs = conv.turn(rng, context)
        body = sum(len(m["content"]) for m in msgs) + 40 * len(msgs)
        done = views[rng.randrange(n)]
        report = inflight.pop(0) if len(inflight) > 32 else None
        # The request as the router has it: decoded with its messages left raw (every request
        # is, cache or not: not in the unit). Its keys come from ``prefix_chain``, the router's
        # own step: from the gateway's header, or by decoding the raw messages and keying them.
        raw = encode_request({"model": "m", "messages": msgs})
        req = infer_request_decoder.decode(raw)
        headers = None
        if keys_from == "gateway":  # the gateway's work, in its own process: not in the unit
            g0 = clock()
            headers = {subjects.H_PREFIX_KEYS: chain_header(prompt_keys("m", messages=msgs), "m")}
            g1 = clock()
        c0 = cpu()
        t0 = clock()
        for v, st in due:
            v.state = st
        if last is not None:
            last.outstanding += 1
            last.pending += 1
        if done.outstanding > 0:
            done.outstanding -= 1
        if done.pending > 0:
            done.pending -= 1
        u0 = clock()
        if report is not None:  # an earlier request's reply: what the engine had cached
            idx.correct(report[0], report[1], report[2], now)
        h0 = clock()
        kc = prefix_chain("m", req, raw, headers)
        h1 = clock()
        d = choose_node(fleet, RouteRequest(model="m", prompt_tokens=body // 4, prefix=kc), pol, now, state,
                        cache=idx)
        h2 = clock()
        idx.record(d.node_id, kc, now)
        t3 = clock()
        c3 = cpu()
        last = fleet.get(d.node_id)
        inflight.append((d.node_id, kc, d.cached_tokens))
        conv.node = d.node_id
        if it >= warm:
            units.append((t3 - t0) / 1000.0)
            cpu_units.append((c3 - c0) / 1000.0)
            hashing.append((h1 - h0) / 1000.0)
            if headers is not None:
                gateway.append((g1 - g0) / 1000.0)
            path.append((h2 - h0) / 1000.0)
            upkeep.append((h0 - u0 + t3 - h2) / 1000.0)
            warm_hits += d.cached_tokens > 0
    for xs in (units, cpu_units, hashing, path, upkeep):
        xs.sort()
    return {
        "median": statistics.median(units), "p99": p99(units), "mean": statistics.fmean(units),
        "cpu_median": statistics.median(cpu_units), "cpu_p99": p99(cpu_units),
        "hash_median": statistics.median(hashing), "path_median": statistics.median(path), "path_p99": p99(path),
        "upkeep_median": statistics.median(upkeep), "upkeep_p99": p99(upkeep),
        "entries": float(len(idx)), "warm": warm_hits / iters,
        "gateway_keys_median": statistics.median(gateway) if gateway else 0.0,
    }


def fill_with(idx: Any, node_ids: list[str], systems: list[str], entries: int, context: int,
              rng: random.Random, now: float) -> float:
    """Record prompts (a shared system prompt and ~``context`` bytes of their own) on the
    nodes in turn, served and reported, each node up to 95% of its share, until the index
    holds ``entries`` entries."""
    from zmlcore.policy.prefix import chain_from_bytes, model_seed

    seed = model_seed("m")
    pre = [s.encode() for s in systems]
    have = len(idx)
    room = [nid for nid in node_ids if idx.node(nid).size < 0.95 * idx.node(nid).cap]
    while have < entries and room:
        nxt = []
        for nid in room:
            nc = idx.node(nid)
            before = len(nc)
            kc = chain_from_bytes(rng.choice(pre) + _text(context, rng).encode(), seed)
            idx.record(nid, kc, now)
            idx.correct(nid, kc, 0, now)
            now += 1e-4
            have += len(nc) - before
            # a node whose cap is under a prompt or two evicts as much as it records and would
            # stay below 95% forever: it is full once a record no longer grows it
            if nc.size < 0.95 * nc.cap and len(nc) > before:
                nxt.append(nid)
            if have >= entries:
                break
        room = nxt
    return now


def index_memory(n: int, entries: int, context: int) -> dict[str, float]:
    """Bytes the prefix index holds at ``n`` nodes and ``entries`` entries (tracemalloc: every
    allocation made while filling it, the key chains' own lists excluded)."""
    import tracemalloc

    from zmlcore.policy.prefix import PrefixIndex

    rng = random.Random(7)
    nodes = make_fleet(n, rng)
    systems = [_text(rng.randint(2000, 8000), rng) for _ in range(20)]
    idx = PrefixIndex(max_entries=int(entries * 4))
    for nd in nodes:
        idx.update_node(nd.view.state)
    fill_with(idx, [nd.view.node_id for nd in nodes], systems, entries // 2, context, rng, 1.0)
    # measured: the second half (the index's own structures at scale; the first half's chains
    # are gone, as a router's are once it has dispatched them)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    fill_with(idx, [nd.view.node_id for nd in nodes], systems, entries, context, rng, 2.0)
    gc.collect()
    used = (tracemalloc.get_traced_memory()[0] - base) * entries / max(1, entries - entries // 2)
    tracemalloc.stop()
    st = idx.stats()
    return {"bytes": float(used), "entries": float(st["entries"]), "keys": float(st["keys"]),
            "per_entry": used / max(1, st["entries"])}


def cache_tables(iters: int, sizes: list[int], rate: float, entries: int, context: int,
                 keys_from: str = "router") -> None:
    names = ["latency", "balanced", "cost"]
    pols = [builtin_policy(x) for x in names]
    keys = ("the prompt's keys from its raw messages (decoded and keyed by the router, a request on zml.infer)"
            if keys_from == "router" else
            "the prompt's keys parsed from the gateway's Zml-Prefix-Keys header (the gateway's own keying: "
            "last column, not in the unit)")
    print(f"With the prefix index: {entries:,} index entries, prompts of ~{context // 4:,} tokens "
          f"({context // 1024} KB: ~{context // 512} keys), {iters} decisions per cell, {rate:g} decisions/s, "
          f"polls every 5 s. Per unit: {keys} + choose_node with the index + record + an earlier "
          "request's correct + polls and counters since the previous unit. Wall-clock median / p99 "
          "(CPU-time median / p99), us:\n")
    print("| nodes | " + " | ".join(names) + " | latency, decision path: keys + lookup + choose (median / p99) "
          "| latency, index upkeep: record + correct (median / p99) | keys median | requests that found a warm node "
          "| gateway's keys + header median |")
    print("|---|" + "---|" * (len(names) + 5))
    for n in sizes:
        cells = []
        extra = ""
        for k, pol in enumerate(pols):
            r = cache_cell(n, pol, iters, rate, 5.0, seed=n * 10 + k, entries=entries, context=context,
                           keys_from=keys_from)
            cells.append(f"{r['median']:.1f} / {r['p99']:.1f} ({r['cpu_median']:.0f} / {r['cpu_p99']:.0f})")
            if k == 0:
                extra = (f" {r['path_median']:.1f} / {r['path_p99']:.1f} | {r['upkeep_median']:.1f} / "
                         f"{r['upkeep_p99']:.1f} | {r['hash_median']:.1f} | {100 * r['warm']:.0f}% | "
                         + (f"{r['gateway_keys_median']:.1f} |" if keys_from == "gateway" else "- |"))
        print(f"| {n:,} | " + " | ".join(cells) + " |" + extra)
    m = index_memory(max(sizes), entries, context)
    print(f"\nIndex memory at {max(sizes):,} nodes: {m['entries']:,.0f} entries ({m['keys']:,.0f} distinct keys): "
          f"{m['bytes'] / 2**20:.0f} MiB, {m['per_entry']:.0f} bytes per entry (tracemalloc).\n")


def p99(xs: list[float]) -> float:
    return xs[int(0.99 * (len(xs) - 1))]


def box_speed_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes (median of 5): this shared box's speed moves
    by up to ~1.7x between minutes whatever its load average says (other tenants' work on the
    same cores), so a table is read against the speed it was measured at."""
    def loop() -> int:
        s = 0
        for i in range(1_000_000):
            s += i * i
        return s

    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        loop()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def footer(load0: float, speed0: float) -> None:
    print(f"load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"box speed (a fixed 1 M-step Python loop) before / after: {speed0:.1f} / {box_speed_ms():.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--rate", type=float, default=1000.0, help="decisions per second (virtual time)")
    ap.add_argument("--poll-intervals", default="5,1", help="seconds between polls of one node (health default 5)")
    ap.add_argument("--small", action="store_true", help="only the small-fleet table (both decision paths)")
    ap.add_argument("--cache", action="store_true", help="only the prefix-index table and its memory")
    ap.add_argument("--entries", type=int, default=1_000_000, help="prefix index entries (--cache)")
    ap.add_argument("--context", type=int, default=32_768, help="prompt bytes (--cache): ~4 per token")
    ap.add_argument("--keys-from", choices=("router", "gateway"), default="router",
                    help="(--cache) router: the unit decodes the raw messages and keys them (a request on zml.infer); gateway: "
                         "it parses the gateway's Zml-Prefix-Keys header, the gateway's keying timed apart")
    args = ap.parse_args()
    iters = 1000 if args.quick else 5000
    sizes = [int(x) for x in args.sizes.split(",")]
    load0 = os.getloadavg()[0]
    speed0 = box_speed_ms()
    print(f"# choose_node (us), Python {platform.python_version()}, numpy {__import__('numpy').__version__}\n")
    names = ["balanced", "latency", "cost", "availability", "round_robin"]
    weighted = ResolvedPolicy("weighted", PolicyConfig(strategy="weighted", latency_weight=0.7, cost_weight=0.3,
                                                       queue_threshold=24), ())
    pols = [builtin_policy(x) for x in names] + [weighted, chain_policy(5, "latency"), chain_policy(5, "cost")]
    labels = names + ["weighted (qt 24)", "chain/latency", "chain/cost"]
    if args.cache:
        cache_tables(iters, [int(x) for x in args.sizes.split(",")] if args.sizes != "100,1000,10000" else [1000],
                     args.rate, args.entries, args.context, args.keys_from)
        footer(load0, speed0)
        return
    if args.small:
        small_fleets(pols, labels)
        footer(load0, speed0)
        return
    print(f"Index upkeep included, {iters} decisions per cell, {args.rate:g} decisions/s (virtual time).\n")
    for poll_s in (float(x) for x in args.poll_intervals.split(",")):
        print(f"Poll interval {poll_s:g} s. Decision + index upkeep since the previous decision, wall-clock "
              "median / p99 (CPU-time median / p99 in brackets):\n")
        print("| nodes | polls per decision | " + " | ".join(labels) + " |")
        print("|---|---|" + "---|" * len(labels))
        detail = []
        for n in sizes:
            cells = []
            ppd = 0.0
            for k, pol in enumerate(pols):
                r = run_cell(n, pol, iters, args.rate, poll_s, seed=n * 10 + k)
                ppd = r["polls_per_decision"]
                cells.append(f"{r['median']:.1f} / {r['p99']:.1f} ({r['cpu_median']:.0f} / {r['cpu_p99']:.0f})")
                if pol.name == "balanced":
                    detail.append((n, r))
            print(f"| {n:,} | {ppd:.2f} | " + " | ".join(cells) + " |")
        print("\nbalanced in detail (us, wall-clock): the decision alone, the mean unit, one poll's index update:\n")
        print("| nodes | decision median / p99 | mean unit incl. upkeep | poll update median / p99 |")
        print("|---|---|---|---|")
        for n, r in detail:
            print(f"| {n:,} | {r['dec_median']:.1f} / {r['dec_p99']:.1f} | {r['mean']:.1f} | "
                  f"{r['poll_median']:.1f} / {r['poll_p99']:.1f} |")
        print()
    footer(load0, speed0)


if __name__ == "__main__":
    main()
