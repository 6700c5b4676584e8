"""The warmup service's Prometheus metrics (its /metrics port: [metrics] warmup_port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from zmlcore.messages.placement import PlanReply
from zmlcore.messages.warmup import WarmupEvent
from zmlcore.telemetry.metrics import WAIT_BUCKETS, Children

EVENTS = Children(Counter(
    "zml_warmup_loads", "Model loads by phase (started, loaded, failed, probed), model, node and reason "
    "(quiet_window, fixed_window, serve, keep_warm).", ["model", "node", "phase", "reason"]))
LOAD_TIME = Children(Histogram(
    "zml_warmup_load_seconds", "Time from asking a node to load a model until the model was routable there.",
    ["model", "node"], buckets=WAIT_BUCKETS))


def event(ev: WarmupEvent) -> None:
    EVENTS(ev.model, ev.node_id, ev.phase, ev.reason).inc()
    if ev.phase == "loaded" and ev.elapsed_s is not None:
        LOAD_TIME(ev.model, ev.node_id).observe(ev.elapsed_s)

PLAN_COST = Children(Gauge(
    "zml_placement_cost_per_hour", "$/h of the nodes busy now (which=now) and in the last plan (which=plan).",
    ["which"]))
PLAN_MOVES = Gauge("zml_placement_moves", "Loads and unloads between the placement now and the last plan.")
PLAN_SLO = Children(Gauge(
    "zml_placement_slo_attainment", "Predicted share of a model's demand served within SLO, now and with the plan.",
    ["model", "which"]))
PLAN_SOLVE = Gauge("zml_placement_solve_seconds", "Time the last plan took to solve.")


def plan(rep: PlanReply) -> None:
    PLAN_COST("now").set(rep.cost_now_per_h)
    PLAN_COST("plan").set(rep.cost_plan_per_h)
    PLAN_MOVES.set(len(rep.moves))
    PLAN_SOLVE.set(rep.solve_s)
    for m in rep.models:
        PLAN_SLO(m.model, "now").set(m.slo_now)
        PLAN_SLO(m.model, "plan").set(m.slo_plan)
