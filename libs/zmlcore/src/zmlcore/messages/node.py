"""Node state (health -> routers, KV bucket ``zml_nodes``), router in-flight deltas and the
replicas' shared cooldown/saturation marks."""

from __future__ import annotations

from typing import Literal

import msgspec

from zmlcore.messages.speeds import ModelSpeeds

NodeStatus = Literal["up", "down", "loading", "unknown", "invalid"]


#: A llama-server request's ``lora`` list with every adapter off (``NodeState.lora_count``):
#: what health's calibration and warmup's warm-up send to a node holding ``--lora`` adapters, as
#: routers do for a base model (zml_router.node.lora), so no slot's prompt cache is made under
#: the global scales.
LORA_ALL_OFF: tuple[dict[str, float], ...] = ({"id": 0, "scale": 0.0},)

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
    #: ZML model name -> the engine's name for it (requests to this node carry the latter).
    served_names: dict[str, str] = {}
    #: Models the node is configured for (zml.toml ``models``, ``zml nodes add --serves``) that
    #: its engine neither serves nor is loading (not loaded yet, or named otherwise: ``note``).
    missing_models: list[str] = []
    #: Names the engine serves that are no model of the fleet's (an alias such as llama-server's
    #: ``--alias``, with no ``served_names`` entry): neither routed to nor in ``GET /v1/models``.
    unknown_models: list[str] = []
    #: Models the node is loading now (not routable for them yet).
    loading_models: list[str] = []
    #: Models the placement planner is moving off this node: not routable here any more, still
    #: loaded until the requests already sent finish (docs/placement.md).
    draining_models: list[str] = []
    #: LoRA adapters the engine holds now (vLLM: /v1/models entries with a parent; llama.cpp:
    #: GET /lora-adapters), by the name clients ask for.
    adapters: list[str] = []
    #: llama.cpp: each adapter's id among the ``--lora`` files the engine was started with
    #: (``GET /lora-adapters``; in router mode, among those of its base model's instance, as
    #: ``/v1/models`` lists its launch arguments), by the name clients ask for. A request for one
    #: is sent with its base model's name and ``"lora": [{"id": ID, "scale": 1.0}]`` (llama-server
    #: loads no adapter after start: a request picks one of those by id).
    lora_ids: dict[str, int] = {}
    #: llama.cpp router mode: the adapters each model it can load brings with it (its instance's
    #: ``--lora`` files, a ``--models-preset`` section's), loaded or not: loading the model is
    #: how such a node comes to serve them (the planner places the base there for them).
    model_adapters: dict[str, list[str]] = {}
    #: llama.cpp: how many ``--lora`` files the engine holds (router mode: its loaded models'
    #: instances together), matched to an adapter name or not.
    #: Requests for a base model carry ``"lora": [{"id": 0, "scale": 0.0}]`` (every adapter off),
    #: since a request without ``lora`` runs with the engine's global scales (1.0 from start).
    lora_count: int = 0
    #: LoRA adapters the engine may hold at once (zml.toml ``adapter_slots``; 0: not said).
    adapter_slots: int = 0
    #: The engine loads an adapter a request names that it does not hold (vLLM with a LoRA
    #: resolver plugin, zml.toml ``adapters_on_request``): routers may send it an adapter's
    #: request, the estimate costing the load time (zmlcore.policy.estimate.adapter_load_s).
    adapters_on_request: bool = False
    #: Seconds this node's adapter loads took, as measured (warmup's loads through the engine's
    #: API and the loads its engine made for a request, SpeedSample.adapter_load_s: a moving
    #: mean, zmlcore.policy.estimate.fold_adapter_load_s); 0: none measured yet (the engine's
    #: default is used).
    adapter_load_s: float = 0.0
    #: The engine has put its model to sleep (llama.cpp ``--sleep-idle-seconds``: the next
    #: request wakes it, paying the load time; vLLM sleep mode: its models are not routable
    #: until warmup wakes it with ``/wake_up``).
    sleeping: bool = False
    queue_running: int = 0
    queue_waiting: int = 0
    max_concurrency: int = 0
    kv_cache_usage: float = 0.0
    #: The engine's KV cache geometry (vLLM ``vllm:cache_config_info``: ``block_size`` tokens
    #: per block, ``num_gpu_blocks``); 0: not reported (the accelerator type's default is
    #: used, ``zmlcore.policy.prefix.kv_geometry``).
    kv_block_size: int = 0
    kv_blocks: int = 0
    free_memory_gib: float | None = None
    error_rate: float = 0.0
    #: Recent generation throughput (output tokens/s) and measured speeds if known.
    tokens_per_s: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    #: True when prefill_tps/decode_tps were measured from the engine's counters, False when
    #: they are the accelerator type's assumed profile.
    speeds_measured: bool = False
    #: Where prefill_tps/decode_tps come from: "measured" (the engine's counters), "learned"
    #: (from requests) or "default" (the accelerator type's profile); "" from an older health
    #: service: derive it from ``speeds_measured``.
    speeds_source: str = ""
    #: Unix time the speed estimate last moved from an observation; 0: unknown (or never).
    speeds_at: float = 0.0
    #: Confidence in the speed estimate, 0..1: the probability that both speeds are within 25%
    #: of the estimate (zmlcore.fleet.learn.confidence); 0: not known.
    speeds_confidence: float = 0.0
    #: The estimate's uncertainty, standard deviation of log(speed) (0: not known, an older
    #: health service): routers explore a node in proportion to it (zmlcore.policy.estimate).
    prefill_sigma: float = 0.0
    decode_sigma: float = 0.0
    #: Per-sequence decode slowdown per extra sequence in flight, as learned (0: the type's).
    decode_slowdown: float = 0.0
    #: Each served model's learned speeds (the top-level ones are its busiest model's).
    model_speeds: dict[str, ModelSpeeds] = {}
    health_score: float = 0.0
    cost_per_hour: float = 0.0
    last_ok: float = 0.0
    updated_at: float = 0.0
    # --- added by the health service's adapters and hardware validation (all optional) ---
    #: Unix time of the last successful inference seen on this node (router events or the
    #: engine's own counters).
    last_inference_at: float = 0.0
    #: Completed requests per second over the last poll interval (engine counters).
    requests_per_s: float = 0.0
    #: Recent tokens/s samples, oldest first (one per poll).
    tokens_per_s_history: list[float] = []
    #: Mean time to first token over the last poll interval, from the engine's histogram.
    ttft_s: float | None = None
    #: Consecutive failed probes (a node is "down" after [health] down_after of them).
    consecutive_failures: int = 0
    #: Hardware reported by the node probe (GET /zml/v1/node); empty when the node has none.
    driver_version: str = ""
    device_count: int = 0
    memory_gib: float | None = None
    #: Something an operator should know that does not stop routing ("no node probe: hardware
    #: not validated").
    note: str = ""
    #: "config" (zml.toml) or "registry" (added at run time with zml.admin.nodes.add).
    source: str = "config"
    #: The health service's poll interval: consumers judge freshness against it.
    poll_interval_s: float = 0.0
    #: Seconds since ``updated_at`` when this state was sent in a listing (0 in the KV bucket,
    #: where readers compute ``now - updated_at`` themselves).
    age_s: float = 0.0
    # --- prefix (KV) cache (docs/routing.md) ---
    #: Share of prompt tokens the engine served from its prefix cache over the last poll
    #: (vLLM's prefix_cache_hits / prefix_cache_queries, llama.cpp's cached / all prompt tokens);
    #: None when the engine does not report it or saw no prompt.
    prefix_cache_hit_rate: float | None = None
    #: The engine's counters since it started (tokens looked up, tokens found).
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    #: How routers learn what this node's cache holds: "precise" (its KV events are bridged, see
    #: ``kv_events``), "reported" (its replies say how many tokens were cached) or "approximate"
    #: (only the routers' own decisions).
    cache_fidelity: str = ""
    #: The KV-event bridge for this node: "" (none configured), "live", "replaying" or
    #: "down: <why>".
    kv_events: str = ""
    # --- disaggregated prefill/decode (docs/disaggregation.md) ---
    #: Legs of a split request the node takes ("prefill", "decode"); empty: both (an older
    #: health service, or the default). A node without "decode" serves no whole request.
    roles: list[str] = []
    #: Nodes of one kv_group can hand KV to each other; "": never a leg of a split request.
    kv_group: str = ""
    #: Bandwidth of the node's KV link, Gbit/s (0: unknown).
    kv_gbps: float = 0.0
    #: SGLang: its bootstrap server's port (0: the endpoint's).
    kv_bootstrap_port: int = 0


class InflightDelta(msgspec.Struct, kw_only=True, array_like=True):
    """A router replica's change to a node's load (array-like: sent on every dispatch)."""

    router_id: str
    node_id: str
    #: +1 on dispatch, -1 on completion.
    outstanding: int
    #: +1 on dispatch, -1 at first token (requests still waiting for prefill).
    pending: int
    ts: float
    #: The request's uncached prompt tokens as estimated at dispatch: + on dispatch, - at first
    #: token, alongside ``pending`` (``NodeView.pending_tokens``, the prefill queued ahead).
    tokens: int = 0


class InflightSnapshot(msgspec.Struct, kw_only=True):
    """A router replica's own counts, published every second: peers replace that replica's
    share with it (healing lost deltas) and drop replicas that fall silent."""

    router_id: str
    ts: float
    #: node id -> [outstanding, pending] dispatched by this replica.
    nodes: dict[str, tuple[int, int]] = {}
    #: node id -> uncached prompt tokens of those pending requests (see InflightDelta.tokens).
    tokens: dict[str, int] = {}


MarkKind = Literal["cooldown", "saturated"]
#: The reason of a mark that lifts a node's cooldown (``kind="cooldown"``, ``for_s=0``): the
#: health service sent the node a real request after routers had seen it fail, and it answered,
#: so it is back in service at once instead of idling out the cooldown.
RECOVERED = "recovered"


class NodeMark(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A router replica's verdict on a node, shared on ``zml.node.marks`` so that every
    replica skips a node one of them has just seen fail (``cooldown``) or refuse work
    (``saturated``). ``for_s`` is relative to receipt, so replicas need no shared clock."""

    router_id: str
    node_id: str
    kind: MarkKind
    #: Seconds the node is skipped from now.
    for_s: float
    #: Why: "network", "server", "slow" (no first byte in time), "mid_stream", "overloaded";
    #: ``RECOVERED`` with ``for_s = 0``: the cooldown is lifted (from the health service).
    reason: str = ""
    ts: float = 0.0


node_state_decoder = msgspec.json.Decoder(NodeState)
node_mark_decoder = msgspec.json.Decoder(NodeMark)
