"""Node state (health -> routers, KV bucket ``zml_nodes``) and router in-flight deltas."""

from __future__ import annotations

from typing import Literal

import msgspec

NodeStatus = Literal["up", "down", "loading", "unknown", "invalid"]


class NodeState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One node as the health service last saw it. ``updated_at`` is unix seconds."""

    node_id: str
    accelerator_type: str
    family: str
    endpoint: str
    backend: str = "openai"
    status: NodeStatus = "unknown"
    #: Human-readable reason for a status other than "up" (driver mismatch, probe error...).
    reason: str = ""
    models: list[str] = []
    #: Models the node is loading now (not routable for them yet).
    loading_models: list[str] = []
    queue_running: int = 0
    queue_waiting: int = 0
    max_concurrency: int = 0
    kv_cache_usage: float = 0.0
    free_memory_gib: float | None = None
    error_rate: float = 0.0
    #: Recent generation throughput (output tokens/s) and measured speeds if known.
    tokens_per_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    health_score: float = 0.0
    cost_per_hour: float = 0.0
    last_ok: float = 0.0
    updated_at: float = 0.0


class InflightDelta(msgspec.Struct, kw_only=True, array_like=True):
    """A router replica's change to a node's load (array-like: sent on every dispatch)."""

    router_id: str
    node_id: str
    #: +1 on dispatch, -1 on completion.
    outstanding: int
    #: +1 on dispatch, -1 at first token (requests still waiting for prefill).
    pending: int
    ts: float


node_state_decoder = msgspec.json.Decoder(NodeState)
