"""Warmup decisions, pure: request rate, quiet windows, which node loads what, keep-warm."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from zml_warmup.planner import Load, Want, keep_warm_due, plan_loads
from zml_warmup.rate import QuietDetector, RateTracker, in_fixed_window, metrics_rate
from zmlcore.config import WarmupConfig
from zmlcore.messages import NodeState

M, M2 = "llama", "mistral"


def st(node_id: str, family: str = "H100", *, status: str = "up", models: list[str] | None = None,
       loading: list[str] | None = None, rps: float = 0.0, last_inf: float = 0.0) -> NodeState:
    acc = {"H100": "nvidia_h100", "MI300X": "amd_mi300x", "A100": "nvidia_a100",
           "Inferentia2": "aws_inferentia2"}[family]
    return NodeState(node_id=node_id, accelerator_type=acc, family=family, endpoint=f"http://{node_id}",
                     status=status, models=models or [], loading_models=loading or [], requests_per_s=rps,
                     last_inference_at=last_inf)  # type: ignore[arg-type]


def want(node_id: str, family: str = "H100", models: tuple[str, ...] = (M,)) -> Want:
    acc = {"H100": "nvidia_h100", "MI300X": "amd_mi300x", "A100": "nvidia_a100",
           "Inferentia2": "aws_inferentia2"}[family]
    return Want(node_id, acc, family, models)


def plan(wants: list[Want], states: list[NodeState], *, quiet: bool = True, k: int = 1,
         progress: list[tuple[str, str]] | None = None, blocked: list[tuple[str, str]] | None = None) -> list[Load]:
    return plan_loads(wants=wants, states={s.node_id: s for s in states}, warm_models=[M], quiet={M: quiet},
                      in_progress=progress or [], max_concurrent=k, priority_families=["MI300X"],
                      blocked=blocked or [])


def test_rate_over_window_and_early_span() -> None:
    r = RateTracker(window_s=10.0, started_at=0.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        r.record(M, t)
    assert r.rate(M, 4.0) == 1.0  # 4 events in the 4 s observed so far
    assert r.rate(M, 20.0) == 0.0 and r.rate(M2, 5.0) == 0.0


def test_metrics_rate_shares_a_node_between_its_models() -> None:
    states = [st("a", models=[M, M2], rps=2.0), st("b", models=[M], rps=1.0), st("c", models=[M2], rps=5.0)]
    assert metrics_rate(M, states) == 2.0


def test_quiet_needs_the_minimum_time_and_busy_resets_it() -> None:
    q = QuietDetector(WarmupConfig(quiet_rps=0.5, quiet_min_s=60.0), started_at=0.0)
    assert not q.update(M, 0.0, 30.0)  # quiet since start, not long enough
    assert q.update(M, 0.0, 61.0)
    assert not q.update(M, 3.0, 62.0)  # busy
    assert not q.update(M, 0.1, 100.0)  # quiet again since 100
    assert q.update(M, 0.1, 161.0)


def ts(hh: int, mm: int) -> float:
    return datetime(2026, 11, 29, hh, mm, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(("windows", "at", "inside"), [
    (["02:00-05:00"], (3, 0), True),
    (["02:00-05:00"], (5, 0), False),
    (["23:00-02:00"], (23, 30), True),
    (["23:00-02:00"], (1, 59), True),
    (["23:00-02:00"], (12, 0), False),
    ([], (3, 0), False),
])
def test_fixed_windows_utc(windows: list[str], at: tuple[int, int], inside: bool) -> None:
    assert in_fixed_window(windows, ts(*at)) is inside


def test_fixed_window_makes_a_busy_model_quiet() -> None:
    q = QuietDetector(WarmupConfig(quiet_rps=0.5, quiet_min_s=60.0, quiet_windows=["02:00-05:00"]), 0.0)
    assert q.update(M, 100.0, ts(3, 0)) and q.reason(ts(3, 0)) == "fixed_window"
    assert not q.update(M, 100.0, ts(6, 0)) and q.reason(ts(6, 0)) == "quiet_window"


def test_slow_cold_start_family_first_and_at_most_k() -> None:
    wants = [want("h100-1"), want("a100-1", "A100"), want("mi300x-1", "MI300X"), want("inf2-1", "Inferentia2")]
    states = [st(w.node_id, w.family) for w in wants]
    assert plan(wants, states) == [Load("mi300x-1", M)]
    # then by typical load time: Inferentia2 (40 s) > A100 (24 s) > H100 (20 s)
    assert plan(wants, states, k=4) == [Load("mi300x-1", M), Load("inf2-1", M), Load("a100-1", M), Load("h100-1", M)]


def test_nothing_when_busy_loaded_loading_down_or_slots_taken() -> None:
    wants = [want("mi300x-1", "MI300X"), want("h100-1")]
    assert plan(wants, [st("mi300x-1", "MI300X"), st("h100-1")], quiet=False) == []
    assert plan(wants, [st("mi300x-1", "MI300X", models=[M]), st("h100-1", status="down")]) == []
    assert plan(wants, [st("mi300x-1", "MI300X", loading=[M]), st("h100-1")]) == []  # 1 slot, taken
    assert plan(wants, [st("mi300x-1", "MI300X", loading=[M]), st("h100-1")], k=2) == [Load("h100-1", M)]
    assert plan(wants, [st("mi300x-1", "MI300X"), st("h100-1")], progress=[("mi300x-1", M)]) == []
    assert plan(wants, [st("mi300x-1", "MI300X"), st("h100-1")], blocked=[("mi300x-1", M)]) == [Load("h100-1", M)]
    assert plan(wants, [st("mi300x-1", "MI300X", status="invalid"), st("h100-1")]) == [Load("h100-1", M)]


def test_only_warm_models_on_nodes_that_want_them() -> None:
    wants = [want("h100-1", models=(M2,))]
    assert plan(wants, [st("h100-1")]) == []


def test_keep_warm_after_idleness() -> None:
    states = {"a": st("a", models=[M], last_inf=100.0), "b": st("b", models=[M, M2], last_inf=0.0),
              "c": st("c", models=[M], status="down")}
    due = keep_warm_due(states=states, keep_warm={M: 300.0}, last_used={("a", M): 900.0}, now=1000.0)
    assert due == [Load("b", M)]
