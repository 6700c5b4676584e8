"""Public data types of the SDK: policies, results, stream chunks, batch results.

Plain dataclasses (no pydantic needed at import time). ``Routing`` mirrors the one wire schema
of routing metadata (``zmlcore.messages.RoutingInfo``) field for field; tests/unit/test_routingmeta.py
fails when the two drift. ``Policy`` validates at creation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from zml._fleet import known_families
from zmlcore.config import PolicyConfig, validate_policy, with_choices
from zmlcore.errors import PolicyConfigError
from zmlcore.messages import InlinePolicy

__all__ = [
    "BatchResult",
    "Choice",
    "EmbeddingResult",
    "InferMeta",
    "InferResult",
    "Message",
    "Metrics",
    "Policy",
    "Routing",
    "StreamChunk",
    "TranscriptionResult",
    "Usage",
]

@dataclass(frozen=True, kw_only=False)
class Policy:
    """A routing policy passed per call, validated when created.

    Example::

        policy = zml.Policy(
            name="llama3-production",
            accelerator_chain=["H100", "MI300X"],
            latency_target_ms=500,
            cost_priority="balanced",
        )
        client.infer(model=..., messages=[...], policy=policy)

    Values are checked at once (known ``strategy``/``cost_priority``, non-negative weights,
    consistent options) and every family of the chain must be registered: in ``families`` when
    given, else in the zml.toml (``config_path``, or found in the working directory or a
    parent) or in the fleet the SDK talks to (``ZML_ENDPOINT`` or that zml.toml's gateway,
    asked once for families registered at run time). With neither a zml.toml nor
    ``ZML_ENDPOINT`` (or a fleet that does not answer) only the values are checked. Any
    problem raises :class:`zml.PolicyConfigError`.
    """

    name: str
    accelerator_chain: Sequence[str] | None = None
    latency_target_ms: float | None = None
    cost_priority: str | None = None
    strategy: str | None = None
    accelerator_preference: Sequence[dict[str, Any]] | None = None
    latency_weight: float | None = None
    cost_weight: float | None = None
    queue_threshold: int | None = None
    queue_on_saturation: bool | None = None
    max_queue_ms: int | None = None
    families: InitVar[Sequence[str] | None] = None
    config_path: InitVar[str | os.PathLike[str] | None] = None

    def __post_init__(
        self, families: Sequence[str] | None, config_path: str | os.PathLike[str] | None
    ) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PolicyConfigError("policy name must be a non-empty string")
        if isinstance(self.accelerator_chain, str):
            raise PolicyConfigError(f"policy {self.name!r}: accelerator_chain must be a list of families")
        data = {k: v for k, v in self._fields().items() if k != "name" and v is not None}
        try:
            cfg = msgspec.convert(data, PolicyConfig)
        except msgspec.ValidationError as exc:
            raise PolicyConfigError(f"policy {self.name!r}: {with_choices(PolicyConfig, str(exc))}") from exc
        known = list(families) if families is not None else known_families(cfg.chain(), config_path)
        # Without a known fleet only the values are checked: the chain checks itself.
        validate_policy(self.name, cfg, known if known is not None else cfg.chain(), f"policy {self.name!r}")

    def _fields(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "strategy": self.strategy,
            "accelerator_chain": list(self.accelerator_chain) if self.accelerator_chain is not None else None,
            "accelerator_preference": (
                [dict(e) for e in self.accelerator_preference] if self.accelerator_preference is not None else None
            ),
            "latency_target_ms": self.latency_target_ms,
            "cost_priority": self.cost_priority,
            "latency_weight": self.latency_weight,
            "cost_weight": self.cost_weight,
            "queue_threshold": self.queue_threshold,
            "queue_on_saturation": self.queue_on_saturation,
            "max_queue_ms": self.max_queue_ms,
        }

    def to_wire(self) -> InlinePolicy:
        """The ``policy`` object sent with a request (``zmlcore.messages.InlinePolicy``)."""
        return msgspec.convert({k: v for k, v in self._fields().items() if v is not None}, InlinePolicy)


@dataclass(slots=True)
class Message:
    """An OpenAI chat message of a reply."""

    role: str = "assistant"
    content: str | None = None


@dataclass(slots=True)
class Choice:
    """One OpenAI choice. ``message.content`` and ``text`` hold the same output."""

    index: int = 0
    message: Message = field(default_factory=Message)
    text: str = ""
    finish_reason: str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(slots=True)
class Routing:
    """Where and how a request was routed (``result.routing``): every field of the routing
    metadata, whichever transport the reply came over. The fields and their meaning are
    ``zmlcore.messages.RoutingInfo``'s (the wire schema; docs/http-api.md lists them). A plain
    dataclass, as in 0.3: ``dataclasses.asdict(result)`` gives plain dicts all the way down.

    Example::

        r = client.infer(model="meta-llama/llama-3-8b-instruct", prompt="Hi", max_tokens=16)
        print(r.routing.node_id, r.routing.family, r.routing.router_id, r.routing.attempts)
    """

    node_id: str = ""
    accelerator_type: str = ""
    family: str = ""
    policy: str = ""
    queue_depth_at_dispatch: int = 0
    decision_id: str = ""
    request_id: str = ""
    attempts: int = 1
    time_to_first_token: float | None = None
    total_tokens: int | None = None
    # Fields after 0.3's, in the wire schema's order.
    router_id: str = ""
    label: str = ""
    cached_tokens_estimated: int | None = None
    cached_tokens: int | None = None
    #: Nodes that failed part-way through the answer, each continued by the next:
    #: ``node@tokens:failure`` comma-separated (docs/http-api.md, "When a node fails mid-answer").
    continued_from: str | None = None
    #: Flow control (docs/routing.md "Flow control"): the request's band, the band it asked for
    #: when its key allowed less, its tenant's share used (x fair share), its wait in the
    #: saturation queue, its latency targets, what admission predicted, the measured TPOT and
    #: whether the targets were met ("met", "missed"; "admitted" in a stream's start).
    priority: str = ""
    priority_lowered_from: str = ""
    share_used: float | None = None
    queued_ms: int | None = None
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    tpot_ms: float | None = None
    slo: str = ""
    #: The node that prefilled the prompt and handed its KV to ``node_id`` (None when one node
    #: served it whole), the prefill leg's milliseconds, and a failed prefill leg
    #: (``node:failure``) whose request was served whole instead (docs/disaggregation.md).
    prefill_node: str | None = None
    prefill_ms: float | None = None
    prefill_failed: str | None = None

    @property
    def queue_depth(self) -> int:
        """Alias of ``queue_depth_at_dispatch``."""
        return self.queue_depth_at_dispatch


@dataclass(slots=True)
class InferMeta:
    """``result.metadata``: the API reference's InferMeta fields."""

    accelerator_id: str = ""
    routing_policy: str = ""
    time_to_first_token: float | None = None
    queue_depth_at_dispatch: int = 0
    total_tokens: int = 0


@dataclass(slots=True)
class Metrics:
    """Client-side measurements of one call (``result.metrics``).

    ``retries``: attempts after the first; ``queue_wait_s``: time spent waiting for the client's
    rate limiter or batch slot; ``service_s``: time of the successful attempt; ``latency_s``:
    from the call to the reply, everything included.
    """

    retries: int = 0
    queue_wait_s: float = 0.0
    service_s: float = 0.0
    latency_s: float = 0.0


@dataclass(slots=True)
class InferResult:
    """The reply of ``infer()``: text, OpenAI-style choices, routing and metrics.

    Example::

        r = client.infer(model="meta-llama/llama-3-8b-instruct", prompt="Hi", max_tokens=16)
        print(r.text, r.metadata.accelerator_id, r.routing.family, r.metrics.retries)
    """

    text: str
    choices: list[Choice]
    routing: Routing
    metadata: InferMeta
    usage: Usage = field(default_factory=Usage)
    metrics: Metrics = field(default_factory=Metrics)
    id: str = ""
    model: str = ""
    #: The parsed output when ``response_format`` was given (None if parsing failed).
    output_parsed: Any = None
    #: The reply JSON as received.
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def output_text(self) -> str:
        """Alias of ``text``."""
        return self.text


@dataclass(slots=True)
class EmbeddingResult:
    """The reply of ``embed()``: one vector per input, in input order, and the routing.

    Example::

        r = client.embed("BAAI/bge-small-en-v1.5", ["first text", "second text"])
        print(len(r.embeddings), len(r.embeddings[0]), r.routing.node_id, r.usage.prompt_tokens)
    """

    embeddings: list[list[float]]
    routing: Routing
    metadata: InferMeta
    usage: Usage = field(default_factory=Usage)
    metrics: Metrics = field(default_factory=Metrics)
    model: str = ""
    #: The reply JSON as received (OpenAI's ``{"object": "list", "data": [...]}``).
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StreamChunk:
    """One streamed piece of output (``delta`` text of an OpenAI chunk)."""

    text: str
    index: int = 0
    finish_reason: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class TranscriptionResult:
    """The reply of ``transcribe()`` / ``translate()``: the text, what the format adds, the routing.

    Example::

        r = client.transcribe("meeting.wav", model="whisper-1", response_format="verbose_json")
        print(r.text, r.duration, len(r.segments), r.routing.node_id)

    ``text`` is the transcript (``json``/``verbose_json``: the reply's ``text``; ``text``: the body
    without its final newline; ``srt``/``vtt``: the subtitle file as the node wrote it).
    """

    text: str
    routing: Routing
    metadata: InferMeta
    response_format: str = "json"
    #: Tokens, when the node bills by tokens (OpenAI's gpt-4o-transcribe ``usage``); else zeros.
    usage: Usage = field(default_factory=Usage)
    metrics: Metrics = field(default_factory=Metrics)
    #: ``verbose_json``: the language and the seconds of audio (also ``json``'s ``usage.seconds``).
    language: str | None = None
    duration: float | None = None
    #: ``verbose_json``: the segments and (``timestamp_granularities=["word"]``) the words, as dicts.
    segments: list[dict[str, Any]] = field(default_factory=list)
    words: list[dict[str, Any]] = field(default_factory=list)
    #: The node's content type (``application/json``, ``text/plain``, ``text/vtt``...).
    content_type: str = ""
    model: str = ""
    #: The reply as received: its JSON object, or its text (``text``, ``srt``, ``vtt``).
    raw: Any = None

    @property
    def output_text(self) -> str:
        """Alias of ``text``."""
        return self.text


#: What a batch's items come back as (InferResult for ``infer_batch``, TranscriptionResult...).
T = TypeVar("T")


@dataclass(slots=True)
class BatchResult(Generic[T]):
    """Results of a batch (``infer_batch``, ``transcribe_batch``) in input order: ``results[i]``
    or ``errors[i]`` is set.

    Iterating yields the results (None where the item failed).
    """

    results: list[T | None]
    errors: list[BaseException | None]

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[T | None]:
        return iter(self.results)

    def __getitem__(self, index: int) -> T | None:
        return self.results[index]

    @property
    def succeeded(self) -> int:
        return sum(r is not None for r in self.results)

    @property
    def failed(self) -> int:
        return sum(e is not None for e in self.errors)
