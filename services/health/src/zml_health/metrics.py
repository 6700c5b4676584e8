"""The health service's Prometheus metrics (its /metrics port: [metrics] health_port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from zmlcore.messages import NodeState
from zmlcore.telemetry.metrics import Children

PROBES = Children(Counter(
    "zml_health_probes", "Node polls, by node and result (ok, loading, slow, failed).", ["node", "result"]))
PROBE_TIME = Children(Histogram(
    "zml_health_probe_seconds", "Time one poll of a node took (engine probe plus node probe).", ["node"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)))
TRANSITIONS = Children(Counter(
    "zml_health_status_changes", "Node status changes, by node and new status.", ["node", "status"]))

PREFIX_HIT_RATIO = Children(Gauge(
    "zml_prefix_cache_engine_hit_ratio",
    "Share of prompt tokens the node's engine served from its prefix cache over the last poll "
    "(vLLM prefix_cache_hits / prefix_cache_queries, llama.cpp cached / all prompt tokens).", ["node"]))
KV_BLOCKS = Children(Gauge(
    "zml_prefix_cache_engine_blocks", "The node's KV cache size in blocks, as its engine reports it.", ["node"]))
KV_BLOCK_SIZE = Children(Gauge(
    "zml_prefix_cache_engine_block_size", "Tokens per KV-cache block of the node's engine.", ["node"]))

CALIBRATIONS = Children(Counter(
    "zml_health_calibrations", "Calibration requests sent to nodes whose speeds were uncertain, by node and "
    "result (ok, failed).", ["node", "result"]))
SPEED = Children(Gauge(
    "zml_node_speed_tokens_per_second", "A node's learned speed with nothing else in flight, by node and kind "
    "(prefill, decode: per sequence).", ["node", "kind"]))
SPEED_CONFIDENCE = Children(Gauge(
    "zml_node_speed_confidence", "Probability that the node's learned speeds are within 25% (0..1).", ["node"]))

_last: dict[str, str] = {}


RECOVERIES = Children(Counter(
    "zml_health_recoveries", "Cooled-down nodes probed back into service (a real request answered after routers "
    "saw them fail), by node.", ["node"]))


def recovered(node_id: str) -> None:
    RECOVERIES(node_id).inc()


def calibrated(node_id: str, ok: bool) -> None:
    CALIBRATIONS(node_id, "ok" if ok else "failed").inc()


def polled(node_id: str, ok: bool, loading: bool, slow: bool, seconds: float, state: NodeState) -> None:
    result = "ok" if ok else "loading" if loading else "slow" if slow else "failed"
    PROBES(node_id, result).inc()
    PROBE_TIME(node_id).observe(seconds)
    if state.prefix_cache_hit_rate is not None:
        PREFIX_HIT_RATIO(node_id).set(state.prefix_cache_hit_rate)
    SPEED(node_id, "prefill").set(state.prefill_tps)
    SPEED(node_id, "decode").set(state.decode_tps)
    SPEED_CONFIDENCE(node_id).set(state.speeds_confidence)
    if state.kv_blocks:
        KV_BLOCKS(node_id).set(state.kv_blocks)
    if state.kv_block_size:
        KV_BLOCK_SIZE(node_id).set(state.kv_block_size)
    if _last.get(node_id) != state.status:
        _last[node_id] = state.status
        TRANSITIONS(node_id, state.status).inc()
