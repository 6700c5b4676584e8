"""Inference request and reply messages (subject ``zml.infer``).

The request is an OpenAI chat-completions (or completions, or embeddings) body plus ZML's
optional routing fields, so a raw NATS publisher sends the same JSON it would POST to the gateway. Unknown
OpenAI parameters (``top_p``, ``stop``, ``seed``...) are not declared here: they are kept in
the raw payload and forwarded to the backend untouched.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

#: Keys that are ZML's own and are removed before the body goes to a backend.
ZML_REQUEST_KEYS = ("policy", "routing", "accelerator_id", "request_id", "timeout_ms", "continue_on_failure", "zml")


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    # Text, OpenAI content parts, or None (assistant tool calls); forwarded as sent.
    content: str | list[Any] | None = None
    name: str | None = None


class InlinePolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A policy passed per call instead of a name (the SDK's ``zml.Policy``)."""

    name: str = "inline"
    strategy: str | None = None
    accelerator_chain: list[str] | None = None
    accelerator_preference: list[dict[str, Any]] | None = None
    latency_target_ms: float | None = None
    cost_priority: str | None = None
    latency_weight: float | None = None
    cost_weight: float | None = None
    queue_threshold: int | None = None
    queue_on_saturation: bool | None = None
    max_queue_ms: int | None = None
    continue_on_failure: bool | None = None


class InferRequest(msgspec.Struct, kw_only=True):
    """What the gateway, the SDK and raw NATS publishers send to ``zml.infer``."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: list[ChatMessage] | None = None
    #: Completions-style prompt (``/v1/completions`` or the SDK's ``prompt=``).
    prompt: str | list[str] | None = None
    #: Text to embed (``/v1/embeddings``): a string, a list of strings, token ids or lists of
    #: token ids. ``encoding_format`` and ``dimensions`` are forwarded as sent.
    input: str | list[Any] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # --- ZML routing fields (all optional) ---
    #: Policy name from zml.toml, or an inline policy object.
    policy: str | InlinePolicy | None = None
    #: The API reference's spelling of a per-call policy name.
    routing: str | None = None
    #: Pin a node by id; bypasses routing.
    accelerator_id: str | None = None
    request_id: str | None = None
    timeout_ms: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: False: if the node fails part-way, end with the error instead of continuing the answer on
    #: another node (docs/http-api.md, "When a node fails mid-answer").
    continue_on_failure: bool | None = None

    def kind(self) -> Literal["chat", "completion", "embedding"]:
        if self.input is not None:
            return "embedding"
        return "chat" if self.messages is not None else "completion"

    def shape_error(self) -> str | None:
        """Why the request cannot be served whatever the fleet, or None."""
        given = [k for k in ("messages", "prompt", "input") if getattr(self, k) is not None]
        if len(given) != 1:
            return "give exactly one of `messages` (chat), `prompt` (completions) or `input` (embeddings)"
        if self.input is None:
            return None
        if self.stream:
            return "embeddings are not streamed: drop `stream`"
        items = [self.input] if isinstance(self.input, str) else self.input
        if not items:
            return "`input` is empty"
        if not (all(isinstance(i, str) for i in items) or all(isinstance(i, int) for i in items)
                or all(isinstance(i, list) and i and all(isinstance(t, int) for t in i) for i in items)):
            return "`input` must be a string, a list of strings, token ids or lists of token ids"
        return None


class ContinuedFrom(msgspec.Struct, kw_only=True):
    """A node whose answer another node continued (it failed part-way)."""

    node_id: str
    #: Tokens of the answer that node produced (content chunks relayed from it).
    tokens: int
    #: How it failed: network (crash, reset, dropped connection), server (an error status or
    #: the engine's error event), slow (nothing within the inter-token deadline).
    failure: str


class RoutingInfo(msgspec.Struct, kw_only=True):
    """Routing metadata: in reply bodies as ``"zml"``, as ``x-zml-*`` HTTP headers, in
    ``Zml-*`` NATS headers, and (compact) in the ``Zml-Routing`` header sent to the backend."""

    node_id: str
    accelerator_type: str
    family: str
    policy: str
    queue_depth_at_dispatch: int
    decision_id: str
    request_id: str = ""
    attempts: int = 1
    #: Router replica that made the decision.
    router_id: str = ""
    #: Seconds from the router receiving the request to the first output token (or the full
    #: reply for non-streaming backends that send everything at once).
    time_to_first_token: float | None = None
    total_tokens: int | None = None
    #: The API key's cost-attribution label ("" without one).
    label: str = ""
    #: The nodes that failed part-way through this answer, in order, each continued by the
    #: next (``node_id`` finished it); None when one node wrote it all.
    continued_from: list[ContinuedFrom] | None = None


class StreamStart(msgspec.Struct, kw_only=True):
    """First message of a streamed reply (``Zml-Stream: start``)."""

    routing: RoutingInfo


infer_request_decoder = msgspec.json.Decoder(InferRequest)
routing_info_decoder = msgspec.json.Decoder(RoutingInfo)
