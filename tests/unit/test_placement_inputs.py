"""What the warmup service feeds the planner (demand from completions, offers from node
states) and the plan as `zml plan` shows it. Pure."""

from __future__ import annotations

from zmlcore.config import parse_config
from zmlcore.messages import NodeState
from zml_warmup import placer
from zml_warmup.demand import DemandWindow
from zml.cli.plan import render

CFG_DATA: dict = {
    "planner": {"mode": "advise", "models": {"m": {"ttft_s": 1.0, "memory_gib": 40}}},
    "nodes": [
        {"id": "big", "accelerator": "nvidia_h100", "endpoint": "http://a", "backend": "llamacpp", "models": ["m", "q"]},
        {"id": "small", "accelerator": "nvidia_a100", "endpoint": "http://b", "backend": "llamacpp", "models": ["m", "q"]},
        {"id": "tiny", "accelerator": "aws_inferentia2", "endpoint": "http://c", "models": ["m", "q"],
         "adapter_slots": 2},
    ],
    "adapters": {"t": {"base": "q", "path": "/x"}},
}
CFG = parse_config(CFG_DATA)


def state(node: str, acc: str, fam: str, price: float, models: list[str], *, memory: float, pf: float,
          dc: float, status: str = "up") -> NodeState:
    return NodeState(node_id=node, accelerator_type=acc, family=fam, endpoint="http://x", status=status,  # type: ignore[arg-type]
                     models=models, cost_per_hour=price, memory_gib=memory, prefill_tps=pf, decode_tps=dc,
                     max_concurrency=16)


STATES = {
    "big": state("big", "nvidia_h100", "H100", 4.0, ["m"], memory=80, pf=10000, dc=60),
    "small": state("small", "nvidia_a100", "A100", 2.0, [], memory=80, pf=5500, dc=33),
    "tiny": state("tiny", "aws_inferentia2", "Inferentia2", 0.8, ["q"], memory=32, pf=3000, dc=18),
}


def demand() -> DemandWindow:
    d = DemandWindow(60.0, 0.0)
    for i in range(60):
        d.record("m", float(i), 2000, 100)
        d.record("t", float(i), 100, 10)
    return d


def test_demand_window_measures_rate_and_shape() -> None:
    s = demand().shape("m", 60.0)
    assert s.rate == 1.0 and s.mean_prompt == 2000 and s.mean_output == 100
    assert demand().shape("m", 200.0).rate == 0.0  # out of the window


def test_offers_come_from_measured_speeds_memory_and_slo() -> None:
    inputs = placer.gather(CFG, STATES, {n.id: tuple(n.models) for n in CFG.nodes}, demand(), 60.0)
    offers = {o.node_id: o for o in inputs.offers}
    # m needs 40 GiB: not on the 32 GiB node; a 2,000-token prompt at 5,500 tok/s meets ttft 1 s
    assert "m" not in offers["tiny"].capacity and offers["small"].capacity["m"] > 0
    assert offers["big"].capacity["m"] > offers["small"].capacity["m"]
    assert offers["tiny"].adapter_slots == 2 and offers["big"].models == {"m"}
    # an adapter's requests count for it and for its base, not as a model
    assert [(a.adapter, a.base, a.rate) for a in inputs.adapters] == [("t", "q", 1.0)]
    assert {d.model: d.rate for d in inputs.demands} == {"m": 1.0, "q": 0.0}
    assert inputs.shapes["m"] == (2000.0, 100.0) and inputs.shapes["q"] == (100.0, 10.0)


def test_a_node_not_up_is_not_planned_on() -> None:
    states = {**STATES, "small": state("small", "nvidia_a100", "A100", 2.0, [], memory=80, pf=5500, dc=33,
                                       status="down")}
    inputs = placer.gather(CFG, states, {}, demand(), 60.0)
    assert "small" not in {o.node_id for o in inputs.offers}


def test_the_plan_as_zml_plan_shows_it() -> None:
    inputs = placer.gather(CFG, STATES, {n.id: tuple(n.models) for n in CFG.nodes}, demand(), 60.0)
    target = placer.make_plan(CFG, inputs)
    rep = placer.reply(CFG, inputs, target, STATES, 60.0)
    assert rep.cost_now_per_h == 4.8 and rep.cost_plan_per_h == 2.8  # m to the A100, q stays
    assert [(m.kind, m.node_id, m.name) for m in rep.moves] == [
        ("load", "small", "m"), ("unload", "big", "m"), ("load_adapter", "tiny", "t")]
    assert any(a.startswith("release: 1 H100 node(s) idle in the plan (big)") for a in rep.advice)
    text = "\n".join(render(rep))
    assert "planner mode advise: $4.80/h now, $2.80/h planned (3 move(s)" in text
    assert "m" in text and "big -> small" in text and "load adapter t on tiny" in text


def test_demand_beyond_the_fleet_is_advice_to_add_nodes() -> None:
    d = DemandWindow(60.0, 0.0)
    for i in range(60 * 500):
        d.record("m", i / 500, 2000, 100)
    inputs = placer.gather(CFG, STATES, {n.id: tuple(n.models) for n in CFG.nodes}, d, 60.0)
    rep = placer.reply(CFG, inputs, placer.make_plan(CFG, inputs), STATES, 60.0)
    add = [a for a in rep.advice if a.startswith("add: m needs")]
    assert add and "most req/s per $ on" in add[0]
    assert rep.models[0].slo_plan < 1.0


def test_adapter_home_is_a_node_of_its_base_with_room() -> None:
    assert placer.adapter_home(CFG, STATES, "t") == "tiny"
    full = {**STATES, "tiny": NodeState(node_id="tiny", accelerator_type="aws_inferentia2", family="Inferentia2",
                                        endpoint="http://c", status="up", models=["q", "a1", "a2"],
                                        adapters=["a1", "a2"])}
    assert placer.adapter_home(CFG, full, "t") is None


def test_a_warm_model_keeps_a_replica_without_demand() -> None:
    cfg = parse_config({**{"nodes": [n for n in CFG_DATA["nodes"]]}, "models": {"q": {"warm": True}},
                        "planner": {"mode": "apply"}})
    inputs = placer.gather(cfg, STATES, {n.id: tuple(n.models) for n in cfg.nodes}, DemandWindow(60.0, 0.0), 60.0)
    assert {d.model: d.min_replicas for d in inputs.demands} == {"m": 0, "q": 1}
    plan = placer.make_plan(cfg, inputs)
    assert plan.nodes_of("q") == ["tiny"] and plan.nodes_of("m") == []  # q stays where it is, m goes


def test_outside_quiet_windows_only_loads_of_short_models_run() -> None:
    from zmlcore.placement.moves import Step

    d = DemandWindow(60.0, 0.0)
    for i in range(60 * 30):  # 30 req/s of m: more than big alone serves within SLO
        d.record("m", i / 30, 2000, 100)
    inputs = placer.gather(CFG, STATES, {n.id: tuple(n.models) for n in CFG.nodes}, d, 60.0)
    assert placer.short_models(inputs) == {"m"}
    run = [Step("load", "small", "m"), Step("load", "small", "q"), Step("unload", "big", "x")]
    now, later = placer.defer_outside_quiet(run, {"m"})
    assert [str(s) for s in now] == ["load m on small", "unload x on big"]
    assert [s.name for s in later] == ["q"] and "quiet_windows" in later[0].waiting


def test_a_rising_model_is_planned_for_the_rate_ahead_of_its_measured_one() -> None:
    """The rate a 60 s demand window measures is behind a rising model, and its new replicas
    serve only once loaded: with [planner] forecast_horizon_s the planner provides for the rate
    its trend reaches that far ahead (measured at each plan), and never less than the rate now."""
    cfg = parse_config({**CFG_DATA, "planner": {**CFG_DATA["planner"], "forecast_horizon_s": 600.0,
                                                 "trend_s": 1800.0}})
    from zmlcore.placement.forecast import RateHistory

    d = DemandWindow(60.0, 0.0)
    hist = RateHistory(cfg.planner.trend_s)
    seen = []
    t = 0.0
    for minute in range(1, 31):  # m: 1 req/s more every 10 minutes
        rate = 1 + (minute - 1) // 10
        while t < minute * 60.0:
            d.record("m", t, 2000, 100)
            t += 1.0 / rate
        inputs = placer.gather(cfg, STATES, {n.id: tuple(n.models) for n in cfg.nodes}, d, minute * 60.0, hist)
        seen.append((d.shape("m", minute * 60.0).rate, {x.model: x.rate for x in inputs.demands}["m"]))
    measured, planned = seen[-1]
    assert 2.9 <= measured <= 3.1 and planned > measured + 0.5  # ~+1 req/s per 600 s ahead
    assert all(p >= m for m, p in seen)
    # without the history: the rate measured now, as before
    plain = placer.gather(cfg, STATES, {n.id: tuple(n.models) for n in cfg.nodes}, d, 1800.0)
    assert {x.model: x.rate for x in plain.demands}["m"] == measured
