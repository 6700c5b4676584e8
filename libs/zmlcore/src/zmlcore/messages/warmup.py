"""Warmup wire messages: router completion events, warmup progress, and ``zml serve``.

* ``zml.events.completed`` — :class:`RequestCompleted`, published by every router once per
  finished request (success or error). The warmup service measures per-model request rate and
  per-node idleness from them; the health service counts per-node errors and the last
  successful inference.
* ``zml.events.warmup`` — :class:`WarmupEvent`, published by the warmup service when a load
  starts, finishes or fails.
* ``zml.warmup.serve`` — request :class:`ServeRequest`, reply :class:`ServeReply` (or an
  error body with ``Zml-Error-Code``).

Example (what a router publishes)::

    ev = RequestCompleted(model="m", node_id="h100-1", family="H100", ok=True, ts=time.time(),
                          ttft_s=0.2)
    await nc.publish(subjects.event(subjects.EVENT_COMPLETED), completed_encoder.encode(ev))
"""

from __future__ import annotations

from typing import Literal

import msgspec

from zmlcore.messages.speeds import SpeedSample


class RequestCompleted(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One finished inference request, as the router saw it."""

    #: Canonical model name (aliases resolved).
    model: str
    #: Node that served (or last failed) the request; "" when no node was chosen.
    node_id: str = ""
    family: str = ""
    #: True when the client got a successful answer.
    ok: bool = True
    #: ZML error code when not ok (MODEL_NOT_LOADED, BACKEND_ERROR, ...).
    error_code: str = ""
    #: True when the final error was ``node_id``'s (network error, 5xx): counts in its error rate.
    node_error: bool = False
    #: Other nodes tried first that failed this request (network error, 5xx) before failover:
    #: each counts as one node error for that node.
    failed_nodes: list[str] = []
    #: Unix time the request finished.
    ts: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1
    router_id: str = ""
    request_id: str = ""
    #: Nodes abandoned for this request because no first byte came within the router's
    #: per-attempt deadline (also in ``failed_nodes``/``node_id``): health marks them slow.
    slow_nodes: list[str] = []
    #: The API key's cost-attribution label ("" without one).
    label: str = ""
    #: What the final attempt showed of ``node_id``'s speeds (the health service learns from
    #: it, zmlcore.fleet.learn); None when it showed nothing (no first byte, an error).
    speed: SpeedSample | None = None


class CompletionCounts(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of :class:`RequestCompleted` the health service counts (decoding only these
    skips the strings it never reads; a test keeps them a subset of RequestCompleted's)."""

    node_id: str = ""
    ok: bool = True
    node_error: bool = False
    failed_nodes: list[str] = []
    ts: float = 0.0
    slow_nodes: list[str] = []
    model: str = ""
    speed: SpeedSample | None = None


#: "draining": the placement planner is about to unload ``model`` from ``node_id``: health takes
#: it out of the node's routable models (routers stop sending it there) until "unloaded".
WarmupPhase = Literal["started", "loaded", "failed", "probed", "draining", "unloaded"]


class WarmupEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    node_id: str
    model: str
    phase: WarmupPhase
    #: "quiet_window", "fixed_window", "serve", "keep_warm", "placement".
    reason: str = ""
    #: How the load was asked for: "vllm_wake_up", "llamacpp_load", "warmup_request".
    mechanism: str = ""
    message: str = ""
    ts: float = 0.0
    elapsed_s: float | None = None


class ServeRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Load ``model`` now on the chosen nodes (default: every node configured with it)."""

    model: str
    #: Node ids; empty: all nodes that list the model in zml.toml / the registry.
    nodes: list[str] = []
    #: Families (H100, MI300X...); combined with ``nodes`` as an intersection when both given.
    family: list[str] = []


class ServeTarget(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    node_id: str
    #: "loaded" (already), "loading" (asked now or already in progress), "failed", "skipped".
    state: str
    mechanism: str = ""
    message: str = ""


class ServeReply(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    targets: list[ServeTarget] = []


completed_encoder = msgspec.json.Encoder()
completed_decoder = msgspec.json.Decoder(RequestCompleted)
completion_counts_decoder = msgspec.json.Decoder(CompletionCounts)
warmup_event_decoder = msgspec.json.Decoder(WarmupEvent)
serve_request_decoder = msgspec.json.Decoder(ServeRequest)
serve_reply_decoder = msgspec.json.Decoder(ServeReply)
