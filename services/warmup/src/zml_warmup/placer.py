"""The placement planner's inputs from what the warmup service knows, and its plan as the
operator reads it (pure: no I/O; the service feeds states and demand, and executes steps).

* :func:`offers` turns the nodes' states (measured speeds, price, memory) and zml.toml's
  planning facts into :class:`~zmlcore.placement.NodeOffer`: a node is offered only the models
  it is configured for (its engine can load them: a llama.cpp --models-dir, a vLLM started with
  it), at the SLO capacity its speeds give for each model's measured request shape.
* :func:`holding` is what the nodes hold now, as the step planner reads it.
* :func:`reply` is the plan as ``zml plan`` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zmlcore.config import PlannerModelConfig, ZMLConfig
from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.messages import NodeState
from zmlcore.messages.placement import ModelPlan, PlanMove, PlanReply
from zmlcore.placement import AdapterDemand, ModelDemand, NodeOffer, Placement, PlanParams, evaluate, plan
from zmlcore.placement import slo_capacity
from zmlcore.placement.forecast import Lookahead, RateHistory, ahead
from zmlcore.placement.moves import NodeNow, Step, all_steps
from zml_warmup.demand import DemandWindow

_DEFAULT = PlannerModelConfig()


@dataclass(frozen=True, slots=True)
class Inputs:
    offers: list[NodeOffer]
    demands: list[ModelDemand]
    adapters: list[AdapterDemand]
    #: model -> (mean prompt, mean output) planned for
    shapes: dict[str, tuple[float, float]]


def node_models(cfg: ZMLConfig, wants: Mapping[str, tuple[str, ...]], st: NodeState) -> set[str]:
    """Models a node's engine can hold: configured for it, or held now (adapters apart)."""
    held = set(wants.get(st.node_id, ())) | set(st.models) | set(st.loading_models) | set(st.draining_models)
    return held - set(cfg.adapters)


def lookahead(cfg: ZMLConfig) -> Lookahead:
    pc = cfg.planner
    return Lookahead(pc.forecast_horizon_s, pc.trend_s, pc.forecast_spread)


def gather(cfg: ZMLConfig, states: Mapping[str, NodeState], wants: Mapping[str, tuple[str, ...]],
           demand: DemandWindow, now: float, history: RateHistory | None = None) -> Inputs:
    """Everything :func:`zmlcore.placement.plan` reads, from the service's state. With the
    ``history`` of the rates measured at earlier plans (this one's is added), each rate is the
    one looked ahead ([planner] forecast_horizon_s, forecast_spread)."""
    pc = cfg.planner
    la = lookahead(cfg)
    adapter_base = {name: ad.base for name, ad in cfg.adapters.items()}
    models = set(cfg.base_model_names())
    for ms in wants.values():
        models.update(m for m in ms if m not in adapter_base)
    rates: dict[str, float] = {}
    shapes: dict[str, tuple[float, float]] = {}
    adapters: list[AdapterDemand] = []
    sums: dict[str, list[float]] = {}
    for name in demand.names():
        sh = demand.shape(name, now)
        rate = sh.rate if history is None else ahead(history.observe(name, now, sh.rate), la)
        base = adapter_base.get(name)
        model = base or cfg.resolve_model(name)
        if base is not None:
            adapters.append(AdapterDemand(name, base, rate))
        else:
            rates[model] = rates.get(model, 0.0) + rate
        models.add(model)
        if sh.mean_prompt is not None and sh.mean_output is not None and sh.rate > 0:
            acc = sums.setdefault(model, [0.0, 0.0, 0.0])
            acc[0] += sh.rate
            acc[1] += sh.rate * sh.mean_prompt
            acc[2] += sh.rate * sh.mean_output
    for name in cfg.adapters:
        if name not in demand.names():
            adapters.append(AdapterDemand(name, cfg.adapters[name].base, 0.0))
    for m in models:
        mc = pc.models.get(m, _DEFAULT)
        got = sums.get(m)
        shapes[m] = (got[1] / got[0], got[2] / got[0]) if got else (mc.mean_prompt_tokens, mc.mean_output_tokens)
    # a model marked warm ([models] warm = true) keeps a replica whatever its demand
    warm = {m for m, mc in cfg.models.items() if mc.warm}
    demands = [ModelDemand(m, rates.get(m, 0.0), max(pc.models.get(m, _DEFAULT).min_replicas, int(m in warm)))
               for m in sorted(models)]
    slots = {n.id: (n.model_slots, n.adapter_slots) for n in cfg.nodes}
    out: list[NodeOffer] = []
    for node_id, st in sorted(states.items()):
        if st.status != "up":
            continue  # down, loading its engine or invalid: nothing to plan on it now
        n_slots, a_slots = slots.get(node_id, (1, 0))
        acc_type = ACCELERATORS.get(st.accelerator_type)
        memory = st.memory_gib or (acc_type.memory_gib if acc_type else 0.0)
        caps: dict[str, float] = {}
        for m in node_models(cfg, wants, st):
            mc = pc.models.get(m, _DEFAULT)
            if memory and mc.memory_gib > memory / n_slots:
                continue
            prompt, output = shapes.get(m, (mc.mean_prompt_tokens, mc.mean_output_tokens))
            caps[m] = slo_capacity(prefill_tps=st.prefill_tps * mc.speed_factor,
                                   decode_tps=st.decode_tps * mc.speed_factor,
                                   max_concurrency=st.max_concurrency or (acc_type.max_concurrency if acc_type else 1),
                                   mean_prompt=prompt, mean_output=output, ttft_s=mc.ttft_s, tpot_s=mc.tpot_s,
                                   headroom=pc.headroom, miss_share=pc.ttft_miss_share)
        held = (frozenset(st.models) | frozenset(st.loading_models) | frozenset(st.draining_models)) - set(cfg.adapters)
        fixed = fixed_adapters(st)
        # llama.cpp router mode: the adapters its models bring, loaded or not (placing the base
        # there is how it serves them)
        ads = frozenset(st.adapters) | {a for m in caps for a in st.model_adapters.get(m, ())}
        out.append(NodeOffer(node_id, st.family, st.cost_per_hour, caps, slots=n_slots,
                             adapter_slots=len(ads) if fixed else a_slots,
                             models=held, adapters=ads, adapters_fixed=fixed))
    return Inputs(out, demands, adapters, shapes)


def params(cfg: ZMLConfig) -> PlanParams:
    return PlanParams(move_cost_per_h=cfg.planner.move_cost_per_h, time_limit_s=cfg.planner.time_limit_s)


def make_plan(cfg: ZMLConfig, inputs: Inputs) -> Placement:
    return plan(inputs.offers, inputs.demands, inputs.adapters, params(cfg))


def holding(states: Mapping[str, NodeState], cfg: ZMLConfig) -> dict[str, NodeNow]:
    """What each node holds now (draining models are still loaded)."""
    slots = {n.id: (n.model_slots, n.adapter_slots) for n in cfg.nodes}
    out = {}
    for node_id, st in states.items():
        n_slots, a_slots = slots.get(node_id, (1, 0))
        held = (frozenset(st.models) | frozenset(st.draining_models)) - set(cfg.adapters)
        # llama.cpp router mode: a model's adapters come and go with it (no move of their own)
        ads = frozenset(st.adapters) | {a for m in (*held, *st.loading_models) for a in st.model_adapters.get(m, ())}
        fixed = fixed_adapters(st)
        out[node_id] = NodeNow(held, frozenset(st.loading_models), ads, up=st.status == "up",
                               slots=n_slots, adapter_slots=len(ads) if fixed else a_slots, adapters_fixed=fixed)
    return out


def fixed_adapters(st: NodeState) -> bool:
    """The node's engine loads no adapter at run time: llama-server holds the ``--lora`` files
    it was started with (a request picks one by id) and nothing else, TGI those it was launched
    with (``LORA_ADAPTERS``), so the plan keeps those where their base stays and puts no other
    there."""
    return st.backend in ("llamacpp", "tgi")


def reply(cfg: ZMLConfig, inputs: Inputs, target: Placement | None, states: Mapping[str, NodeState],
          planned_at: float, run: list[Step] | None = None, wait: list[Step] | None = None,
          blocked: bool = False) -> PlanReply:
    mode = cfg.planner.mode
    if target is None:
        return PlanReply(mode=mode, message="no plan yet" if mode != "off" else
                         'nothing is planned: [planner] mode = "off" (see docs/placement.md)')
    now_held = {o.node_id: o.models for o in inputs.offers}
    rates = {d.model: d.rate for d in inputs.demands}
    for a in inputs.adapters:
        rates[a.base] = rates.get(a.base, 0.0) + a.rate
    ev_now = evaluate(inputs.offers, {n: frozenset(m) for n, m in now_held.items()}, rates)
    models = []
    for m in sorted(rates):
        d = rates[m]
        cap_now, cap_plan = ev_now.capacity.get(m, 0.0), target.capacity.get(m, 0.0)
        nodes_now = sorted(n for n, ms in now_held.items() if m in ms)
        if not d and not nodes_now and not target.nodes_of(m):
            continue
        models.append(ModelPlan(model=m, demand_rps=round(d, 4), capacity_now_rps=round(cap_now, 3),
                                capacity_plan_rps=round(cap_plan, 3),
                                slo_now=round(min(1.0, cap_now / d), 4) if d else 1.0,
                                slo_plan=round(min(1.0, cap_plan / d), 4) if d else 1.0,
                                nodes_now=nodes_now, nodes_plan=target.nodes_of(m)))
    if run is None:
        held = holding(states, cfg)
        steps = all_steps({n: held[n] for n in held if n in target.models}, target.models, target.adapters)
        moves = [PlanMove(kind=s.kind, node_id=s.node_id, name=s.name) for s in steps]
    else:
        moves = [PlanMove(kind=s.kind, node_id=s.node_id, name=s.name, waiting=s.waiting) for s in [*run, *(wait or [])]]
    advice = []
    for m, u in sorted(target.unserved.items()):
        fams: dict[str, float] = {}
        for o in inputs.offers:
            if o.capacity.get(m, 0) > 0 and o.cost_per_hour > 0:
                fams[o.family] = max(fams.get(o.family, 0.0), o.capacity[m] / o.cost_per_hour)
        best = max(fams, key=lambda f: fams[f]) if fams else ""
        advice.append(f"add: {m} needs {u:.2f} req/s more than the fleet serves within SLO"
                      + (f" (most req/s per $ on {best})" if best else ""))
    idle: dict[str, list[str]] = {}
    for o in inputs.offers:
        if not target.models.get(o.node_id):
            idle.setdefault(o.family, []).append(o.node_id)
    for fam, nodes in sorted(idle.items()):
        advice.append(f"release: {len(nodes)} {fam} node(s) idle in the plan ({', '.join(nodes[:5])}"
                      + (", ..." if len(nodes) > 5 else "") + ")")
    return PlanReply(mode=mode, planned_at=planned_at, cost_now_per_h=round(ev_now.cost_per_hour, 4),
                     cost_plan_per_h=round(target.cost_per_hour, 4), solve_s=round(target.solve_s, 4), models=models,
                     adapters_now={o.node_id: sorted(o.adapters) for o in inputs.offers if o.adapters},
                     adapters_plan={n: sorted(a) for n, a in target.adapters.items() if a},
                     moves=moves, blocked=blocked, advice=advice)


def adapter_home(cfg: ZMLConfig, states: Mapping[str, NodeState], adapter: str) -> str | None:
    """Where to load an adapter a request found nowhere: a node up serving its base with a free
    adapter slot, the one with fewest adapters and shortest queue (None: nowhere)."""
    base = cfg.adapters[adapter].base
    slots = {n.id: n.adapter_slots for n in cfg.nodes}
    fits = [st for st in states.values()
            if st.status == "up" and base in st.models and not fixed_adapters(st)
            and len(st.adapters) < slots.get(st.node_id, 0) and adapter not in st.adapters]
    if not fits:
        return None
    return min(fits, key=lambda st: (len(st.adapters), st.queue_running + st.queue_waiting, st.node_id)).node_id


def demand_rates(demands: Sequence[ModelDemand], adapters: Sequence[AdapterDemand]) -> dict[str, float]:
    """Requests/s per model, its adapters' included (they run on it)."""
    rates = {d.model: d.rate for d in demands}
    for a in adapters:
        rates[a.base] = rates.get(a.base, 0.0) + a.rate
    return rates


def short_models(inputs: Inputs) -> set[str]:
    """Models whose nodes now give less SLO capacity than their demand: their loads are urgent
    (a load elsewhere only saves money and may wait for a quiet window)."""
    rates = demand_rates(inputs.demands, inputs.adapters)
    cap = evaluate(inputs.offers, {o.node_id: o.models for o in inputs.offers}, rates).capacity
    return {m for m, r in rates.items() if r > 0 and cap.get(m, 0.0) < r}


def defer_outside_quiet(run: list[Step], short: set[str]) -> tuple[list[Step], list[Step]]:
    """Outside the quiet windows: (loads of short models and every other step, loads that wait)."""
    now = [s for s in run if s.kind != "load" or s.name in short]
    later = [Step(s.kind, s.node_id, s.name, "outside [warmup] quiet_windows (it only saves money)")
             for s in run if s.kind == "load" and s.name not in short]
    return now, later
