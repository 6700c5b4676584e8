"""What the request path asks of a node (one :class:`Dispatch`) and where on the node it goes."""

from __future__ import annotations

from dataclasses import dataclass

from zmlcore.messages.audio import AUDIO_PATHS
from zmlcore.policy import Decision, RouteRequest

#: The node endpoint of each request kind (``InferRequest.kind()``).
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings",
         **AUDIO_PATHS}


@dataclass(slots=True)
class Dispatch:
    decision: Decision
    attempt: int
    rr: RouteRequest
    stream: bool
    #: Ask for the rest of the answer the requester has so far (zml_router.answer.continuation.body).
    continuation: bool = False
