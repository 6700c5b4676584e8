"""Placement planner wire messages (warmup service).

* ``zml.warmup.plan`` — request :class:`PlanRequest`, reply :class:`PlanReply`: the placement
  now and the proposed one, their $/h, each model's demand and SLO capacity, the moves and
  the advice (nodes to add or release per family). ``zml plan`` prints it.
* ``zml.events.placement`` — :class:`PlacementEvent`: a new plan, a move started, done,
  waiting or blocked.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class PlanRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    #: Plan again now (with the demand measured so far) instead of answering the last plan.
    fresh: bool = False


class ModelPlan(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    model: str
    #: Requests/s measured over the window (its adapters' included).
    demand_rps: float = 0.0
    #: SLO capacity (requests/s) of the nodes holding it now, and in the plan.
    capacity_now_rps: float = 0.0
    capacity_plan_rps: float = 0.0
    #: Predicted share of its demand served within SLO, now and with the plan (fluid estimate:
    #: capacity over demand, capped at 1).
    slo_now: float = 1.0
    slo_plan: float = 1.0
    nodes_now: list[str] = []
    nodes_plan: list[str] = []


class PlanMove(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    #: "load", "unload", "load_adapter", "unload_adapter".
    kind: str
    node_id: str
    name: str
    #: Why it cannot run yet ("" when it can).
    waiting: str = ""


class PlanReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    mode: str
    #: Unix time of the plan; 0: none made yet.
    planned_at: float = 0.0
    cost_now_per_h: float = 0.0
    cost_plan_per_h: float = 0.0
    solve_s: float = 0.0
    models: list[ModelPlan] = []
    #: node -> adapters, now and planned (only nodes with some).
    adapters_now: dict[str, list[str]] = {}
    adapters_plan: dict[str, list[str]] = {}
    moves: list[PlanMove] = []
    #: True when moves remain but none can run without dropping a model (needs a spare node).
    blocked: bool = False
    #: Operator advice: "add": demand the fleet cannot serve within SLO; "release": nodes idle in the plan.
    advice: list[str] = []
    message: str = ""


PlacementPhase = Literal["planned", "move_started", "move_done", "move_failed", "blocked"]


class PlacementEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    phase: PlacementPhase
    ts: float = 0.0
    node_id: str = ""
    #: A model or an adapter.
    name: str = ""
    kind: str = ""
    message: str = ""
    cost_now_per_h: float = 0.0
    cost_plan_per_h: float = 0.0
    moves: int = 0


plan_request_decoder = msgspec.json.Decoder(PlanRequest)
plan_reply_decoder = msgspec.json.Decoder(PlanReply)
placement_event_decoder = msgspec.json.Decoder(PlacementEvent)
