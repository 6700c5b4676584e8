"""Builders shared by the test_policy_* modules (and a check of them)."""

from __future__ import annotations

import pytest

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.messages import NodeState
from zmlcore.policy import NodeView

NOW = 1000.0


def node(
    node_id: str,
    accel: str = "nvidia_h100",
    *,
    family: str | None = None,
    status: str = "up",
    models: tuple[str, ...] = ("m",),
    loading: tuple[str, ...] = (),
    running: int = 0,
    waiting: int = 0,
    cost: float | None = None,
    health: float = 100.0,
    updated_at: float = NOW,
    outstanding: int = 0,
    pending: int = 0,
    cooldown_until: float = 0.0,
    saturated_until: float = 0.0,
) -> NodeView:
    a = ACCELERATORS[accel]
    st = NodeState(
        node_id=node_id, accelerator_type=accel, family=family or a.family, endpoint=f"http://{node_id}",
        status=status, models=list(models), loading_models=list(loading), queue_running=running,  # type: ignore[arg-type]
        queue_waiting=waiting, max_concurrency=a.max_concurrency,
        cost_per_hour=a.cost_per_hour if cost is None else cost, health_score=health, updated_at=updated_at,
    )
    return NodeView(st, outstanding=outstanding, pending=pending, cooldown_until=cooldown_until,
                    saturated_until=saturated_until)


def fleet5() -> list[NodeView]:
    """One idle node of each family, in registration order H100, A100, MI300X, Gaudi2, Inf2."""
    return [
        node("h100", "nvidia_h100"), node("a100", "nvidia_a100"), node("mi300x", "amd_mi300x"),
        node("gaudi2", "intel_gaudi2"), node("inf2", "aws_inferentia2"),
    ]


def test_fleet5_is_one_idle_node_per_family():
    assert [v.state.family for v in fleet5()] == ["H100", "A100", "MI300X", "Gaudi2", "Inferentia2"]
    assert all(v.effective_outstanding() == 0 for v in fleet5())


def test_route_requests_own_init_sets_every_field_with_the_dataclass_defaults() -> None:
    """RouteRequest writes its own __init__ (a frozen dataclass's costs 1.6 us per request): it
    must take every field, in order, with the field's default, and stay frozen."""
    import dataclasses
    import inspect

    from zmlcore.policy import RouteRequest

    fields = dataclasses.fields(RouteRequest)
    params = [p for p in inspect.signature(RouteRequest.__init__).parameters.values()
              if p.name != "self" and p.kind != p.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in params] == [
        (f.name, inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default) for f in fields]
    values = {f.name: object() for f in fields}
    r = RouteRequest(**values)  # type: ignore[arg-type]
    assert all(getattr(r, k) is v for k, v in values.items())
    assert dataclasses.replace(r, model="x").model == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.model = "y"  # type: ignore[misc]
