"""The dashboard keeps only the completion events it can show (the last STATS_WINDOW_S): it
used to keep up to MAX_EVENTS whatever their age, ~300 bytes each, so the gateway's memory
crept up for hours under steady traffic (the soak bench saw ~0.1 MiB a minute)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec

from zml_gateway import dashboard
from zml_gateway.dashboard import STATS_WINDOW_S, Dashboard
from zmlcore.messages.warmup import RequestCompleted


async def test_events_older_than_the_window_are_dropped_as_new_ones_arrive() -> None:
    board = Dashboard(None, None, None)  # type: ignore[arg-type]
    now = time.monotonic()
    for i in range(1000):  # old traffic, long gone from every figure the page shows
        board.events.append((now - STATS_WINDOW_S - 100 + i * 0.01, "H100", "h100-1", True, "", 0.1, 0.2))
    board.events.append((now - 1.0, "H100", "h100-1", True, "", 0.1, 0.2))  # recent: kept
    ev = RequestCompleted(model="m", node_id="h100-2", family="H100", ok=True, ts=time.time(), ttft_s=0.1, latency_s=0.3)
    msg: Any = SimpleNamespace(data=msgspec.json.encode(ev))
    board._on_completed(msg)
    assert [e[2] for e in board.events] == ["h100-1", "h100-2"]
    assert board.stats(time.monotonic())["decisions_per_s"]["total"] == round(2 / dashboard.RATE_WINDOW_S, 2)


async def test_the_placement_view_is_the_last_plan_and_the_latest_moves() -> None:
    from zmlcore.messages.placement import PlacementEvent

    board = Dashboard(None, None, None)  # type: ignore[arg-type]
    assert board.placement_view(100.0) is None  # planner off: the page says so
    board.saw_placement(PlacementEvent(phase="planned", ts=90.0, cost_now_per_h=6.0, cost_plan_per_h=4.0, moves=2))
    for i, phase in enumerate(("move_started", "move_done")):
        msg: Any = SimpleNamespace(data=msgspec.json.encode(PlacementEvent(
            phase=phase, ts=95.0 + i, node_id="a100-2", name="m", kind="load")))  # type: ignore[arg-type]
        await board._on_placement(msg)
    view = board.placement_view(100.0)
    assert view is not None
    assert (view["cost_now_per_h"], view["cost_plan_per_h"], view["moves_planned"], view["planned_s"]) == (6.0, 4.0, 2, 10.0)
    assert [(m["phase"], m["node"], m["age_s"]) for m in view["moves"]] == [("move_done", "a100-2", 4.0),
                                                                          ("move_started", "a100-2", 5.0)]
