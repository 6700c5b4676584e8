"""The router's admission bound on top of choose_node (no network needed)."""

from __future__ import annotations

import time

import pytest

from zmlcore.config import parse_config
from zmlcore.errors import QueueFullError
from zmlcore.messages import NodeState
from zmlcore.policy import RouteRequest
from zmlcore.policy.resolve import builtin_policy
from zml_router.service import RouterService


def _service(bound: float) -> RouterService:
    cfg = parse_config({"router": {"admission_ttft_s": bound}})
    svc = RouterService(cfg, "r-test")
    now = time.time()
    for node_id, acc, fam in (("h1", "nvidia_h100", "H100"), ("g1", "intel_gaudi2", "Gaudi2")):
        svc.table.upsert(NodeState(node_id=node_id, accelerator_type=acc, family=fam, endpoint="http://x",
                                   status="up", models=["m"], updated_at=now))
    return svc


def test_under_the_bound_the_policy_decides() -> None:
    svc = _service(30.0)
    d = svc.admission.decide(RouteRequest(model="m", prompt_tokens=2000), builtin_policy("latency"))
    assert d.node_id == "h1" and d.estimated_ttft_s < 1


def test_a_policy_pick_over_the_bound_falls_back_to_the_fastest_node() -> None:
    svc = _service(2.0)
    svc.table.add_own("g1", 40, 0)  # the round-robin pick may be the overloaded Gaudi2
    picks = {svc.admission.decide(RouteRequest(model="m"), builtin_policy("round_robin")).node_id for _ in range(4)}
    assert picks == {"h1"}


def test_every_node_over_the_bound_is_queue_full_with_context() -> None:
    svc = _service(2.0)
    svc.table.add_own("h1", 200, 0)
    svc.table.add_own("g1", 200, 0)
    with pytest.raises(QueueFullError) as info:
        svc.admission.decide(RouteRequest(model="m"), builtin_policy("latency"))
    ctx = info.value.routing_context
    assert ctx is not None and ctx["final_error"] == "all_nodes_over_capacity"
    assert ctx["best_estimated_ttft_s"] > 2.0 and "queue_on_saturation" in ctx["recommendation"]


def test_pinned_requests_bypass_the_bound() -> None:
    svc = _service(2.0)
    svc.table.add_own("h1", 200, 0)
    assert svc.admission.decide(RouteRequest(model="m", accelerator_id="h1"), builtin_policy("latency")).node_id == "h1"


def test_when_every_node_cools_down_the_soonest_gets_one_more_chance() -> None:
    svc = _service(30.0)
    now = time.time()
    svc.table.views["h1"].cooldown_until = now + 30
    svc.table.views["g1"].cooldown_until = now + 10
    d = svc.admission.decide(RouteRequest(model="m"), builtin_policy("latency"))
    assert d.node_id == "g1"  # half-open: its cooldown ends first
    assert svc.table.views["h1"].cooldown_until > now  # the other stays out
    # A node that is merely down is not resurrected.
    svc2 = _service(30.0)
    for v in svc2.table.views.values():
        v.state = type(v.state)(**{**{f: getattr(v.state, f) for f in v.state.__struct_fields__}, "status": "down"})
    with pytest.raises(Exception) as info:
        svc2.admission.decide(RouteRequest(model="m"), builtin_policy("latency"))
    assert info.value.code == "NO_HEALTHY_NODES"


def _wait_count(model: str) -> float:
    from zml_router.metrics import QUEUE_WAIT
    return sum(s.value for m in QUEUE_WAIT.metric.collect() for s in m.samples
               if s.name.endswith("_count") and s.labels.get("model") == model)


def test_asking_whether_a_queued_head_has_room_does_not_observe_its_wait() -> None:
    """Regression: the queue asks again each time capacity may have freed (and after a node
    refused the head at once); every "yes" used to observe the head's queue wait, so one
    request's wait was counted several times. It is observed once, when a node takes it."""
    import json

    from zml_router.queue import H_ENQUEUED, QueuedMsg

    svc = _service(30.0)
    qmsg = QueuedMsg("zml.infer", json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                     "_INBOX.x", {H_ENQUEUED: f"{time.time() - 1:.3f}"})
    before = _wait_count("m")
    assert svc.glue.has_room(qmsg) and svc.glue.has_room(qmsg)
    assert _wait_count("m") == before
    svc.glue._waited(qmsg)
    assert _wait_count("m") == before + 1
