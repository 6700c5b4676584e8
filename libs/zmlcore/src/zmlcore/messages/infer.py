"""Inference request and reply messages (subject ``zml.infer``).

The request is an OpenAI chat-completions (or completions, or embeddings) body plus ZML's
optional routing fields, so a raw NATS publisher sends the same JSON it would POST to the gateway. Unknown
OpenAI parameters (``top_p``, ``stop``, ``seed``...) are not declared here: they are kept in
the raw payload and forwarded to the backend untouched.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

#: What a request asks for: the node endpoint it goes to (zmlcore.messages.audio for the last two).
Kind = Literal["chat", "completion", "embedding", "transcription", "translation"]

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
    #: OpenAI's end-user id: the session of a request without ``Zml-Session`` (``x-session-id``),
    #: so a conversation stays on the node that holds its prefix (docs/routing.md).
    user: str | None = None
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

    def kind(self) -> Kind:
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


class RoutingInfo(msgspec.Struct, kw_only=True):
    """Routing metadata of one reply: the one schema every way out is derived from.

    It travels as the reply body's ``"zml"`` object (this Struct, encoded), as ``Zml-*`` NATS
    headers and ``x-zml-*`` HTTP headers (:mod:`zmlcore.reply.routingmeta`, names from
    :data:`ROUTING_HEADER_WORDS`), as ``zml-*`` gRPC metadata (:mod:`zmlcore.rpc.status`), as
    zml.v1's ``Routing`` message (written from this class by ``proto/generate.py``; mapped by
    :mod:`zmlcore.rpc.codec`) and as the SDK's ``zml.Routing`` (a dataclass with the same fields). Adding a field here,
    with a default (then ``python proto/generate.py``, and the same field on ``zml.Routing``),
    adds it to all of them;
    tests/unit/test_routingmeta.py fails on any that drifts.

    Every field has a default so that a reader of an older or partial reply still gets the rest;
    a reply without ``node_id`` carries no routing metadata.
    """

    #: The node that served the request.
    node_id: str = ""
    #: Its accelerator type (``nvidia_h100``...).
    accelerator_type: str = ""
    #: Its accelerator family (``H100``...).
    family: str = ""
    #: The policy applied (a zml.toml name, ``inline``, or the routing strategy's name).
    policy: str = ""
    #: Requests queued at the node when it was chosen.
    queue_depth_at_dispatch: int = 0
    #: Id of the routing decision (in the router's logs and traces).
    decision_id: str = ""
    request_id: str = ""
    #: Dispatch attempts, this one included (more than 1 after a failover).
    attempts: int = 1
    #: Router replica that made the decision.
    router_id: str = ""
    #: Seconds from the router receiving the request to the first output token (or the full
    #: reply for non-streaming backends that send everything at once).
    time_to_first_token: float | None = None
    total_tokens: int | None = None
    #: The API key's cost-attribution label ("" without one).
    label: str = ""
    #: Prompt tokens the router estimated the node held in its prefix cache when it chose it.
    cached_tokens_estimated: int | None = None
    #: Prompt tokens the engine reported it served from its prefix cache
    #: (``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``); None
    #: when it does not say (or, in a stream's start message, not yet).
    cached_tokens: int | None = None
    #: The nodes that failed part-way through this answer, in order, each continued by the next
    #: (``node_id`` finished it): ``node@tokens:failure`` comma-separated, ``tokens`` the
    #: answer's tokens that node produced, ``failure`` network (crash, reset, dropped
    #: connection), server (an error status or the engine's error event) or slow (nothing
    #: within the inter-token deadline); e.g. ``h100-1@37:network``. None when one node wrote it.
    continued_from: str | None = None
    # --- flow control (docs/routing.md "Flow control"): absent on a standard-band request
    # without latency targets that did not wait in the saturation queue ---
    #: The request's band (critical, standard, sheddable, batch).
    priority: str = ""
    #: The band it asked for when that was above what its key allows (it got ``priority``).
    priority_lowered_from: str = ""
    #: Its tenant's recent share of the fleet's tokens, as a multiple of its fair share (1.0:
    #: exactly its weight's share).
    share_used: float | None = None
    #: Milliseconds it waited in the saturation queue.
    queued_ms: int | None = None
    #: Its latency targets (ms) and what admission predicted on the chosen node.
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    #: Measured time per output token (ms), in a non-streamed reply to a request with a target.
    tpot_ms: float | None = None
    #: "met" or "missed" once the reply is whole and the request had a target ("admitted" in a
    #: stream's start message: predicted to meet it).
    slo: str = ""
    #: Disaggregated prefill/decode (docs/disaggregation.md): the node that prefilled the prompt
    #: and handed its KV to ``node_id``, which decoded; None when one node served it whole.
    prefill_node: str | None = None
    #: Milliseconds the prefill leg took (its request to its reply), when there was one.
    prefill_ms: float | None = None
    #: A split whose prefill leg failed, served whole on the decode node instead:
    #: ``node:failure`` (network, server, slow, overloaded...); None otherwise.
    prefill_failed: str | None = None


#: Names published before the rule below: header word of a field whose word is not its name.
_HEADER_WORD_EXCEPTIONS = {"queue_depth_at_dispatch": "Queue-Depth"}
#: RoutingInfo field -> header word: ``Zml-<word>`` on NATS, ``x-zml-<word>`` on HTTP and
#: ``zml-<word>`` in gRPC metadata (both lower-case). The word is the field's name in dashed
#: Title-Case (``router_id`` -> ``Router-Id``).
ROUTING_HEADER_WORDS: dict[str, str] = {
    name: _HEADER_WORD_EXCEPTIONS.get(name) or "-".join(w.capitalize() for w in name.split("_"))
    for name in RoutingInfo.__struct_fields__
}


class StreamStart(msgspec.Struct, kw_only=True):
    """First message of a streamed reply (``Zml-Stream: start``)."""

    routing: RoutingInfo


class StreamResume(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a requester has of a streamed answer whose router went silent (``Zml-Resume`` on
    the request sent again: zmlcore.reply.resume): the router taking it over continues the
    answer from there on a node, as it does when a node fails part-way."""

    #: The answer's text so far (choice 0's content, or a completion's text).
    text: str = ""
    #: Content chunks that carried it (tokens, on engines that stream one token per event).
    tokens: int = 0
    #: The last ``Zml-Seq`` received: the continuation numbers from the next one.
    seq: int = 0
    #: The chunks' ``id`` and ``created`` (the continuation's chunks get the same).
    chunk_id: str | None = None
    created: int | None = None
    #: A ``finish_reason`` was received (only the stream's end was lost), and the usage chunk.
    finished: bool = False
    usage: bool = False
    #: Why the answer so far cannot be continued (tool-call deltas...), or None.
    blocked: str | None = None
    #: The node relaying the answer when its router went silent (its start message's routing),
    #: the attempts made so far and the continuations before this one (``RoutingInfo``'s).
    node_id: str = ""
    attempts: int = 0
    continued_from: str | None = None


infer_request_decoder = msgspec.json.Decoder(InferRequest)
routing_info_decoder = msgspec.json.Decoder(RoutingInfo)
