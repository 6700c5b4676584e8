"""The placement planner: which models each node holds, cheapest first, demand served within
SLO, few moves (pure: no I/O, no clock but the solver's own timing).

The fleet is planned by *classes*: nodes whose price, slots and SLO capacities agree within
``capacity_bucket`` are interchangeable, so the integer program grows with the fleet's kinds,
not its size (1,000 nodes of six kinds make a few hundred variables). Per class ``g`` and model ``m`` (Mélange's bin-packing, with a stability term)::

    minimise   sum_g price_g * on_g + move_cost * sum_gm (add_gm + drop_gm) + big * sum_m unserved_m
    subject to sum_g slots_gm * cap_gm / slots_g + unserved_m >= demand_m     (SLO capacity)
               sum_m slots_gm <= slots_g * on_g,   on_g <= size_g                (room)
               sum_g slots_gm + short_m >= min_replicas_m                        (replicas)
               add_gm >= slots_gm - now_gm,   drop_gm >= now_gm - slots_gm       (moves)

solved by HiGHS through :func:`scipy.optimize.milp`. Classes are then split back into nodes,
each node keeping what it holds where the plan allows. Adapters are placed after, on the nodes
of their base model (:mod:`zmlcore.placement.adapters`).

    >>> from zmlcore.placement import NodeOffer, ModelDemand, plan
    >>> p = plan([NodeOffer("a", "X", 4.0, {"m": 10.0}), NodeOffer("b", "Y", 1.0, {"m": 3.0})],
    ...          [ModelDemand("m", 2.0)])
    >>> sorted(n for n, ms in p.models.items() if ms), p.cost_per_hour
    (['b'], 1.0)
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from zmlcore.placement.adapters import place_adapters
from zmlcore.placement.inputs import AdapterDemand, ModelDemand, NodeOffer, Placement, PlanParams


@dataclass(slots=True)
class _Class:
    nodes: list[NodeOffer]
    price: float
    slots: int
    #: model -> the lowest capacity of the class's nodes for it
    capacity: dict[str, float]
    #: model -> how many of the class's nodes hold it now
    now: dict[str, int]
    #: adapters its nodes hold for good (llama.cpp --lora) among those only such nodes can serve
    fixed: frozenset[str] = frozenset()


def _bucket(value: float, width: float) -> int:
    return 0 if value <= 0 else int(math.floor(math.log(value) / math.log1p(width)))


def classes(offers: Iterable[NodeOffer], models: Sequence[str], width: float,
            pinned: frozenset[str] = frozenset()) -> list[_Class]:
    """Group interchangeable nodes (same price, slots, capacity buckets and, of the ``pinned``
    adapters, the same fixed ones). What they hold now is counted per class: keeping ``k`` of a
    class's holders of a model costs no move, whichever ``k`` (exact for the move count, and it
    keeps the program small)."""
    groups: dict[tuple[object, ...], list[NodeOffer]] = defaultdict(list)
    for o in offers:
        caps = tuple(_bucket(o.capacity.get(m, 0.0), width) if o.capacity.get(m, 0.0) > 0 else None
                     for m in models)
        fixed = frozenset(o.adapters & pinned) if o.adapters_fixed else frozenset()
        groups[(round(o.cost_per_hour, 6), o.slots, caps, tuple(sorted(fixed)))].append(o)
    out = []
    for nodes in sorted(groups.values(), key=lambda ns: min(o.node_id for o in ns)):
        nodes.sort(key=lambda o: o.node_id)
        cap = {m: min(o.capacity.get(m, 0.0) for o in nodes) for m in models}
        now = {m: sum(1 for o in nodes if m in o.models) for m in models}
        fixed = frozenset(nodes[0].adapters & pinned) if nodes[0].adapters_fixed else frozenset()
        out.append(_Class(nodes, nodes[0].cost_per_hour, nodes[0].slots, {m: c for m, c in cap.items() if c > 0},
                          {m: k for m, k in now.items() if k}, fixed))
    return out


def pinned_adapters(offers: Sequence[NodeOffer], adapters: Iterable[AdapterDemand]) -> dict[str, AdapterDemand]:
    """Adapters with traffic that only nodes holding them for good can serve: no node that loads
    adapters at run time can serve their base model (a llama.cpp-only fleet). The plan must keep
    their base on enough of those nodes."""
    loadable = {m for o in offers if o.adapter_slots > 0 and not o.adapters_fixed
                for m, c in o.capacity.items() if c > 0}
    return {a.adapter: a for a in adapters if a.rate > 0 and a.base not in loadable}


def total_demand(demands: Iterable[ModelDemand], adapters: Iterable[AdapterDemand]) -> dict[str, float]:
    """Each model's rate with its adapters' requests added (they run on the base model)."""
    out = {d.model: d.rate for d in demands}
    for a in adapters:
        out[a.base] = out.get(a.base, 0.0) + a.rate
    return out


def plan(offers: Sequence[NodeOffer], demands: Sequence[ModelDemand], adapters: Sequence[AdapterDemand] = (),
         params: PlanParams = PlanParams()) -> Placement:
    """The cheapest placement serving ``demands`` (and ``adapters``) within SLO; see the module
    docstring for the program. Models a node cannot serve within SLO are never put on it."""
    t0 = time.perf_counter()
    demand = total_demand(demands, adapters)
    min_rep = {d.model: d.min_replicas for d in demands}
    models = sorted(demand)
    pinned = pinned_adapters(offers, adapters)
    cls = classes(offers, models, params.capacity_bucket, frozenset(pinned))
    # variable layout: [slots_gm for (g, m) pairs] [add_gm] [drop_gm] [on_g] [unserved_m] [short_m]
    # [unserved_a for pinned adapters]
    pairs = [(g, m) for g, c in enumerate(cls) for m in models if m in c.capacity or m in c.now]
    P, G, M, A = len(pairs), len(cls), len(models), len(pinned)
    n_var = 3 * P + G + 2 * M + A
    o_add, o_drop, o_on, o_un, o_short = P, 2 * P, 3 * P, 3 * P + G, 3 * P + G + M
    o_pin = o_short + M
    midx = {m: i for i, m in enumerate(models)}
    c = np.zeros(n_var)
    c[o_add:o_on] = params.move_cost_per_h
    c[o_on:o_un] = [k.price for k in cls]
    c[o_un:o_short] = params.unserved_cost_per_rps
    c[o_short:] = params.unserved_cost_per_rps  # (and unserved pinned adapters)
    lo, hi = np.zeros(n_var), np.full(n_var, np.inf)
    integrality = np.zeros(n_var)
    integrality[:P] = 1
    integrality[o_on:o_un] = 1
    for k, (g, m) in enumerate(pairs):
        hi[k] = len(cls[g].nodes) if m in cls[g].capacity else 0  # a held model it cannot serve: unload
    hi[o_on:o_un] = [len(k.nodes) for k in cls]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    r_lo: list[float] = []
    r_hi: list[float] = []

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(r_lo)
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        r_lo.append(low)
        r_hi.append(high)

    by_model: dict[str, list[int]] = defaultdict(list)
    by_class: dict[int, list[int]] = defaultdict(list)
    for k, (g, m) in enumerate(pairs):
        by_model[m].append(k)
        by_class[g].append(k)
    for m in models:
        caps = [(k, cls[pairs[k][0]].capacity.get(m, 0.0) / cls[pairs[k][0]].slots) for k in by_model[m]]
        row([*caps, (o_un + midx[m], 1.0)], demand[m], np.inf)
        need = min_rep.get(m, 0) or (1 if demand[m] > 0 else 0)
        if need:
            row([*((k, 1.0) for k in by_model[m]), (o_short + midx[m], 1.0)], need, np.inf)
    for j, (name, pa) in enumerate(sorted(pinned.items())):
        # its requests run only where its base stays on a node holding it
        held = [(k, cls[pairs[k][0]].capacity.get(pa.base, 0.0) / cls[pairs[k][0]].slots)
                for k in by_model.get(pa.base, []) if name in cls[pairs[k][0]].fixed]
        row([*held, (o_pin + j, 1.0)], pa.rate, np.inf)
    for g, k_cls in enumerate(cls):
        row([*((k, 1.0) for k in by_class[g]), (o_on + g, -float(k_cls.slots))], -np.inf, 0.0)
    for k, (g, m) in enumerate(pairs):
        now = cls[g].now.get(m, 0)
        row([(o_add + k, 1.0), (k, -1.0)], -now, np.inf)
        row([(o_drop + k, 1.0), (k, 1.0)], now, np.inf)
    a = coo_matrix((vals, (rows, cols)), shape=(len(r_lo), n_var))
    res = milp(c, constraints=LinearConstraint(a, r_lo, r_hi), integrality=integrality, bounds=Bounds(lo, hi),
               options={"time_limit": params.time_limit_s, "mip_rel_gap": params.mip_rel_gap})
    if res.x is None:
        raise RuntimeError(f"placement solver found no solution: {res.message}")
    x = np.round(res.x).astype(int)
    counts: dict[int, dict[str, int]] = defaultdict(dict)
    for k, (g, m) in enumerate(pairs):
        if x[k] > 0:
            counts[g][m] = int(x[k])
    placed: dict[str, frozenset[str]] = {}
    for g, k_cls in enumerate(cls):
        placed.update(_split(k_cls, counts.get(g, {})))
    out = evaluate(offers, placed, demand)
    homes = place_adapters(offers, placed, adapters)
    unserved = dict(out.unserved)
    for name, a in pinned.items():
        cap = sum(o.capacity.get(a.base, 0.0) / o.slots for o in offers if name in homes.get(o.node_id, ()))
        if a.rate - cap > 1e-9:
            unserved[name] = a.rate - cap
    return Placement(models=placed, adapters=homes, cost_per_hour=out.cost_per_hour, capacity=out.capacity,
                     unserved=unserved, moves=out.moves, solve_s=time.perf_counter() - t0,
                     status=str(res.message))


def _split(k: _Class, counts: dict[str, int]) -> dict[str, frozenset[str]]:
    """A class's per-model slot counts back to nodes: each model stays on nodes that hold it
    (up to its count), the rest fill nodes already busy before waking an idle one, and among
    equals a node with less to unload first: a load there starts at once, where a node still
    serving a model the plan takes away must wait for that model's new replicas, drain and
    unload it (minutes of a new replica's capacity missing while demand has moved)."""
    hold: list[set[str]] = [set() for _ in k.nodes]
    left = dict(counts)
    for i, o in enumerate(k.nodes):
        for m in sorted(o.models):
            if left.get(m, 0) > 0 and len(hold[i]) < k.slots:
                hold[i].add(m)
                left[m] -= 1
    for m, n in sorted(left.items(), key=lambda kv: (-kv[1], kv[0])):
        order = sorted(range(len(k.nodes)), key=lambda i: (not hold[i], len(hold[i]), len(k.nodes[i].models - hold[i]), i))
        for i in order:
            if n <= 0:
                break
            if len(hold[i]) < k.slots and m not in hold[i]:
                hold[i].add(m)
                n -= 1
    return {o.node_id: frozenset(h) for o, h in zip(k.nodes, hold)}


@dataclass(frozen=True, slots=True)
class Evaluation:
    cost_per_hour: float
    capacity: dict[str, float]
    unserved: dict[str, float]
    moves: int

    def objective(self, params: PlanParams) -> float:
        return (self.cost_per_hour + params.move_cost_per_h * self.moves
                + params.unserved_cost_per_rps * sum(self.unserved.values()))


def evaluate(offers: Sequence[NodeOffer], placed: dict[str, frozenset[str]], demand: dict[str, float]) -> Evaluation:
    """What a placement costs and serves: the same numbers for the planner's answer, a static
    placement and a brute-force search. A node holding ``k`` models gives each ``1/slots`` of
    its time (its capacity for each is divided by ``slots``)."""
    cost = 0.0
    cap: dict[str, float] = defaultdict(float)
    moves = 0
    planned = frozenset(demand)
    for o in offers:
        held = placed.get(o.node_id, frozenset())
        moves += len((held ^ o.models) & planned)
        if held:
            cost += o.cost_per_hour
        for m in held:
            cap[m] += o.capacity.get(m, 0.0) / o.slots
    unserved = {m: max(0.0, r - cap.get(m, 0.0)) for m, r in demand.items()}
    return Evaluation(cost, dict(cap), {m: u for m, u in unserved.items() if u > 1e-9}, moves)
