"""Which polled node states the health service writes to the KV bucket (zml_health.publish)."""

from __future__ import annotations

import msgspec

from zml_health.publish import Writes, effective_heartbeat, meaningful_change
from zmlcore.messages import NodeState

ST = NodeState(node_id="n1", accelerator_type="nvidia_h100", family="H100", endpoint="http://n1", status="up",
               models=["m"], queue_running=2, prefill_tps=10_000.0, decode_tps=60.0, health_score=97.0,
               updated_at=100.0, tokens_per_s_history=[1.0])


def poll(**changes: object) -> NodeState:
    return msgspec.structs.replace(ST, **changes)


def test_volatile_fields_and_small_drifts_are_not_changes() -> None:
    assert meaningful_change(ST, poll(updated_at=105.0, last_ok=105.0, tokens_per_s_history=[1.0, 2.0])) is None
    assert meaningful_change(ST, poll(prefill_tps=10_150.0, decode_tps=60.9, health_score=97.5)) is None


def test_routing_inputs_are_changes() -> None:
    assert meaningful_change(ST, poll(status="down")) == "status"
    assert meaningful_change(ST, poll(models=[])) == "models"
    assert meaningful_change(ST, poll(queue_running=3)) == "queue_running"
    assert meaningful_change(ST, poll(prefill_tps=10_300.0)) == "prefill_tps"
    assert meaningful_change(ST, poll(health_score=90.0)) == "health_score"
    assert meaningful_change(ST, poll(free_memory_gib=12.0)) == "free_memory_gib"  # None -> known


def test_writes_on_change_and_as_a_heartbeat_that_never_lets_the_state_age_past_it() -> None:
    w = Writes(heartbeat_s=5.0)
    gap = 1.2  # polls every second, +20% jitter
    assert w.due(ST, 100.0, gap) == "new"
    w.wrote(ST, 100.0)
    now, written = 100.0, [100.0]
    for _ in range(30):  # an idle node: 30 polls, a write only when the next poll could be too late
        now += 1.0
        if w.due(poll(updated_at=now), now, gap):
            w.wrote(poll(updated_at=now), now)
            written.append(now)
    assert len(written) <= 8, written  # vs 31 writes before
    assert all(b - a <= 5.0 for a, b in zip(written, written[1:], strict=False)), written
    assert w.skipped >= 20
    now += 1.0
    assert w.due(poll(updated_at=now, queue_waiting=4), now, gap) == "queue_waiting"  # at once


def test_forget_writes_the_next_state_at_once() -> None:
    w = Writes(heartbeat_s=5.0)
    w.wrote(ST, 100.0)
    assert w.due(poll(updated_at=100.5), 100.5, 1.0) is None
    w.forget("n1")
    assert w.due(poll(updated_at=100.6), 100.6, 1.0) == "new"


def test_heartbeat_is_capped_by_the_readers_staleness_bound() -> None:
    assert effective_heartbeat(5.0, 15.0) == 5.0
    assert effective_heartbeat(30.0, 15.0) == 5.0
    assert effective_heartbeat(5.0, 1.5) == 0.5


def test_completion_counts_read_the_wire_fields_of_request_completed() -> None:
    from zmlcore.messages.warmup import (
        CompletionCounts,
        RequestCompleted,
        completed_encoder,
        completion_counts_decoder,
    )

    full = {f.name: f.type for f in msgspec.structs.fields(RequestCompleted)}
    for f in msgspec.structs.fields(CompletionCounts):
        assert full[f.name] == f.type, f.name
    from zmlcore.messages.speeds import SpeedSample

    sample = SpeedSample(ttft_s=0.1, prefill_tokens=900, inflight=2, decode_s=1.0, decode_tokens=50)
    ev = RequestCompleted(model="m", node_id="n1", ok=False, node_error=True, failed_nodes=["n0"], ts=5.0,
                          slow_nodes=["n0"], request_id="r" * 64, router_id="router-1", speed=sample)
    got = completion_counts_decoder.decode(completed_encoder.encode(ev))
    assert got == CompletionCounts(node_id="n1", ok=False, node_error=True, failed_nodes=["n0"], ts=5.0,
                                   slow_nodes=["n0"], model="m", speed=sample)


def test_completion_events_are_counted_in_bounded_per_second_buckets() -> None:
    from zml_health.tracker import Tracker

    tr = Tracker(started_at=0.0, grace_s=0.0)
    for i in range(10_000):  # 10,000 requests over 100 s, 1% node errors
        tr.record_request(1000.0 + i / 100, ok=i % 100 != 0, node_error=i % 100 == 0)
    assert len(tr.events) == 100
    assert tr.error_rate(1100.0, 60.0) == 0.01
    assert len(tr.events) <= 61 and tr.last_inference_at == 1000.0 + 9_999 / 100


def test_forget_all_after_a_reconnect_writes_every_node_again() -> None:
    w = Writes(heartbeat_s=5.0)
    w.wrote(ST, 100.0)
    w.wrote(poll(node_id="n2"), 100.0)
    w.forget_all()
    assert w.due(poll(updated_at=100.5), 100.5, 1.0) == "new"
    assert w.due(poll(node_id="n2", updated_at=100.5), 100.5, 1.0) == "new"


def test_a_models_learned_slot_wait_is_a_change() -> None:
    # Routers route a model by its model_speeds: a full node's decode time learned (or moved by
    # more than 10%) goes out at once, not at the next heartbeat.
    from zmlcore.messages.speeds import ModelSpeeds

    ms = ModelSpeeds(prefill_tps=10_000.0, decode_tps=60.0, source="measured")
    base = poll(model_speeds={"m": ms})
    assert meaningful_change(base, poll(model_speeds={"m": msgspec.structs.replace(ms, full_decode_s=0.6)})) \
        == "model_speeds"
    full = poll(model_speeds={"m": msgspec.structs.replace(ms, full_decode_s=0.6)})
    assert meaningful_change(full, poll(model_speeds={"m": msgspec.structs.replace(ms, full_decode_s=0.62)})) is None
    assert meaningful_change(full, poll(model_speeds={"m": msgspec.structs.replace(ms, full_decode_s=0.8)})) \
        == "model_speeds"
    assert meaningful_change(base, poll(model_speeds={})) == "model_speeds"
