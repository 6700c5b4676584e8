"""What the request path asks of a node (one :class:`Dispatch`) and where on the node it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zmlcore.messages.audio import AUDIO_PATHS
from zmlcore.policy import Decision, RouteRequest

#: The node endpoint of each request kind (``InferRequest.kind()``).
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings",
         **AUDIO_PATHS}


@dataclass(slots=True)
class Handoff:
    """What a split request's prefill leg handed to its decode leg (zml_router.node.legs): the
    fields the decode leg's body gets (vLLM's ``kv_transfer_params``, llama-server's slot), a
    slot file the decode node restores first, and how long the prefill took."""

    prefill_node: str
    fields: dict[str, Any] = field(default_factory=dict)
    prefill_ms: float = 0.0
    #: llama-server: the slot file to restore on the decode node before its request.
    restore: str = ""
    #: SGLang: the prefill leg, running beside the decode leg (its node holds the room's KV
    #: until the decode node pulls it); awaited, or cancelled, once the decode leg ends.
    running: Any = None


@dataclass(slots=True)
class Dispatch:
    decision: Decision
    attempt: int
    rr: RouteRequest
    stream: bool
    #: Ask for the rest of the answer the requester has so far (zml_router.answer.continuation.body).
    continuation: bool = False
    #: The decode leg of a split request: what its prefill leg handed over.
    handoff: Handoff | None = None
