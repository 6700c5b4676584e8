"""The router's memory of its decisions (zml_router.telemetry.decisions): bounded, and a
record says what happened since the decision."""

from __future__ import annotations

from zmlcore.fleet.decisions import explain
from zmlcore.messages import NodeState, RoutingInfo
from zmlcore.policy import Decision
from zmlcore.policy.types import FamilyEval
from zml_router.outcome import Outcome
from zml_router.telemetry.decisions import DecisionLog


def _state() -> NodeState:
    return NodeState(node_id="h1", accelerator_type="nvidia_h100", family="H100", endpoint="http://h1", status="up",
                     models=["m"], updated_at=1.0, prefill_tps=9000.0, decode_tps=80.0, speeds_source="measured",
                     speeds_at=0.5)


def _decide(log: DecisionLog, did: str, out: Outcome, node: str = "h1") -> RoutingInfo:
    d = Decision(node, "H100", "latency", 2, estimated_ttft_s=0.12, cached_tokens=64, session="kept",
                 evaluated=[FamilyEval("H100", 2), FamilyEval("A100", 1, "cooling down")])
    info = RoutingInfo(node_id=node, accelerator_type="nvidia_h100", decision_id=did, request_id="r1")
    out.info = info
    log.remember(info, d, _state(), "m", 1, out)
    return info


def test_a_record_follows_its_request_to_its_end() -> None:
    log = DecisionLog("router-a")
    out = Outcome()
    info = _decide(log, "d1", out)
    rec = log.record("d1")
    assert rec is not None and rec.outcome == "in_flight" and rec.node_id == "h1" and rec.router_id == "router-a"
    assert rec.prefill_tps == 9000.0 and rec.speeds_source == "measured" and rec.cached_tokens_estimated == 64
    assert [e.rejected_reason for e in rec.evaluated] == ["", "cooling down"]
    info.time_to_first_token = 0.15
    out.ok = True
    rec = log.record("d1")
    assert rec is not None and rec.outcome == "ok" and rec.time_to_first_token == 0.15
    text = "\n".join(explain(rec, now=rec.at + 3))
    assert "9,000 prompt tokens/s" in text and "(measured" in text and "session kept" in text
    assert "A100: 1 node (not taken: cooling down)" in text and "TTFT 0.150 s (estimated 0.120 s)" in text


def test_a_failover_marks_the_first_decision_moved_and_a_failure_says_its_code() -> None:
    log = DecisionLog("r")
    out = Outcome()
    _decide(log, "first", out)
    _decide(log, "second", out, node="h2")
    first, second = log.record("first"), log.record("second")
    assert first is not None and first.outcome == "moved"
    assert second is not None and second.outcome == "in_flight"
    out.error_code = "BACKEND_ERROR"
    second = log.record("second")
    assert second is not None and second.outcome == "failed" and second.error_code == "BACKEND_ERROR"


def test_only_the_last_decisions_are_kept() -> None:
    log = DecisionLog("r", kept=3)
    for i in range(5):
        _decide(log, f"d{i}", Outcome())
    assert len(log) == 3 and log.record("d1") is None and log.record("d4") is not None
    assert log.record("unknown") is None
