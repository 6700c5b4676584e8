"""What the request path asks of a node (one :class:`Dispatch`) or of the relay that ends an
answer itself (:class:`Close`), where on the node it goes, and
what comes back (:class:`AttemptResult`): the node I/O executes and reports, the request's
``route`` decides what follows and writes the request's ``Outcome``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zmlcore.messages import RoutingInfo
from zmlcore.messages.audio import AUDIO_PATHS
from zmlcore.policy import Decision, RouteRequest

from zml_router.node.attempt import AttemptError

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
    #: Ask the node as the caller asked, not as a stream put back together here: it refused the
    #: request asked as a stream (``AttemptError.stream_refused``).
    whole: bool = False
    #: The nodes the answer was continued from, as routing metadata says them
    #: (zml_router.answer.record.continued_from).
    continued_from: str | None = None


@dataclass(slots=True)
class Close:
    """The requester has the whole answer and lost only its end (zml_router.answer.continuation.complete):
    end the stream here, as its node would have; nothing is asked of a node. The flow is over."""

    #: The node that produced the answer (and failed, or whose router died, after it).
    node_id: str
    attempts: int
    #: The requester has every message it asked for (the finish, and the usage if it asked);
    #: only the stream's end is missing: it is sent as the node would have, with the attempt's
    #: routing metadata, and the node is not blamed.
    whole: bool = False
    #: The nodes the answer was continued from, as routing metadata says them.
    continued_from: str | None = None


@dataclass(slots=True)
class AttemptResult:
    """How one attempt went (or how the router ended an answer itself, for ``Close``)."""

    #: The attempt's routing metadata, as the requester got it (None: it never reached a node).
    info: RoutingInfo | None = None
    #: None: the answer is out.
    error: AttemptError | None = None
    #: The token counts the node reported (``prompt_tokens``, ``completion_tokens``), if any.
    usage: dict[str, Any] | None = None
