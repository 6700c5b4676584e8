"""Requests, sans-I/O: the body the gateway and the routers accept (OpenAI's plus ZML's routing
fields) built from call arguments over the client's defaults, and what a transport needs to send
it (:class:`InferCall`: path, NATS and HTTP headers, timeouts, the rate limiter's token estimate).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from zml._errors import BadRequestError, ZMLError
from zml._models import Policy
from zmlcore import subjects

__all__ = ["DEFAULT_MAX_TOKENS", "DEFAULT_TEMPERATURE", "EMBED_DEFAULTS", "H_HTTP_ID_GENERATED", "InferCall",
           "Kind", "TIMEOUT_GRACE_S", "build_embed", "build_infer", "estimate_tokens", "grace_s", "new_request_id",
           "response_format_wire", "trace_headers"]

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.7

#: At most this many extra seconds the client waits beyond the request's server-side timeout,
#: so the server's TIMEOUT error (with its routing context) arrives before the client gives up.
TIMEOUT_GRACE_S = 2.0


def grace_s(timeout_s: float) -> float:
    """The client's extra wait beyond a server-side timeout of ``timeout_s``."""
    return min(TIMEOUT_GRACE_S, 0.25 + 0.1 * timeout_s)


Kind = Literal["chat", "completion", "embedding", "transcription", "translation"]
_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings",
                          "transcription": "/v1/audio/transcriptions", "translation": "/v1/audio/translations"}

_json_encoder = msgspec.json.Encoder()

#: HTTP twin of ``Zml-Id-Generated``: the request id in the body was made up by the SDK.
H_HTTP_ID_GENERATED = "x-zml-id-generated"


@dataclass(slots=True)
class InferCall:
    """A built request: the JSON body plus what the client needs to send and decode it."""

    body: dict[str, Any]
    kind: Kind
    request_id: str
    #: Seconds the transport waits for a reply (or between stream messages).
    timeout_s: float
    response_format: Any = None
    #: Tokens reserved in the client's rate limiter for this call.
    est_tokens: int = 0
    stream: bool = False
    #: The SDK made up ``request_id`` (the caller gave none): unique, so routers skip their
    #: cross-replica duplicate check.
    id_generated: bool = False
    #: The conversation this call belongs to (``session=``): routers keep its requests on the
    #: node that holds its prefix while that node has room (``x-session-id`` / ``Zml-Session``).
    session: str | None = None
    #: An audio call's body, OpenAI's multipart form as built (``body`` then holds only ZML's
    #: routing fields, sent as headers: the form is never rewritten), and its content type.
    content: bytes | None = None
    content_type: str = "application/json"
    #: Flow control (``priority=``, ``ttft_slo_ms=``, ``tpot_slo_ms=``): NATS header -> value
    #: (``x-zml-*`` over HTTP and gRPC; docs/routing.md "Flow control").
    flow: dict[str, str] | None = None

    def encode(self) -> bytes:
        return self.content if self.content is not None else _json_encoder.encode(self.body)

    @property
    def http_path(self) -> str:
        return _PATHS[self.kind]

    def http_headers(self) -> dict[str, str]:
        """Tells the gateway the id is the SDK's own (no cross-replica duplicate check needed),
        and the call's session; an audio call's routing fields too (docs/http-api.md, "Audio")."""
        out = {H_HTTP_ID_GENERATED: "1"} if self.id_generated else {}
        if self.session:
            out["x-session-id"] = self.session
        if self.flow:
            for name, setting in self.flow.items():
                out["x-" + name.lower()] = setting
        if self.content is not None:
            out["content-type"] = self.content_type
            out["x-zml-request-id"] = self.request_id
            out["x-zml-timeout-ms"] = str(self.body["timeout_ms"])
            for key, header in (("policy", "x-zml-policy"), ("accelerator_id", "x-zml-accelerator-id")):
                value = self._routing_field(key)
                if value is not None:
                    out[header] = value
        return out

    def _routing_field(self, key: str) -> str | None:
        """An audio call's ``policy`` (a name, or an inline policy as JSON; ``routing`` spells a
        name too) or ``accelerator_id``, as a header value."""
        value = self.body.get(key)
        if key == "policy" and value is None:
            value = self.body.get("routing")
        if value is None:
            return None
        return value if isinstance(value, str) else _json_encoder.encode(value).decode()

    def nats_headers(self) -> dict[str, str]:
        if self.content is not None:  # audio: the form as built, what it is and its routing in headers
            audio = {subjects.H_AUDIO: self.kind, subjects.H_CONTENT_TYPE: self.content_type}
            for key, header in (("policy", subjects.H_POLICY), ("accelerator_id", subjects.H_ACCELERATOR_ID)):
                value = self._routing_field(key)
                if value is not None:
                    audio[header] = value
            return {**self._nats_headers(), **audio}
        return self._nats_headers()

    def _nats_headers(self) -> dict[str, str]:
        return {
            subjects.H_REQUEST_ID: self.request_id,
            subjects.H_TIMEOUT_MS: str(int(self.body.get("timeout_ms") or self.timeout_s * 1000)),
            **({subjects.H_ID_GENERATED: "1"} if self.id_generated else {}),
            **({subjects.H_SESSION: self.session} if self.session else {}),
            **(self.flow or {}),
            # A stream's chunks as header-less frames: no header block to build or parse per
            # chunk (zmlcore.reply.streamframe; decoded by decode_nats_frame).
            **({subjects.H_ACCEPT_STREAM: subjects.STREAM_FRAMES} if self.stream else {}),
            # The routing metadata once, in the body's zml object (a stream's start message):
            # the SDK reads it there, so a dozen Zml-* headers would only cost parsing.
            subjects.H_ACCEPT_ROUTING: subjects.ROUTING_IN_BODY,
            **trace_headers(),
        }


def trace_headers() -> dict[str, str]:
    """``traceparent`` (W3C) of the caller's current OpenTelemetry span, if there is one: ZML's
    spans join the caller's trace. Empty without a recording span."""
    if _propagator is None or not _otel_trace.get_current_span().get_span_context().is_valid:
        return {}
    out: dict[str, str] = {}
    _propagator.inject(out)
    return out


try:  # opentelemetry-api comes with zml; an SDK vendored without it simply sends no context
    from opentelemetry import trace as _otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _propagator: TraceContextTextMapPropagator | None = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover
    _propagator = None


def new_request_id() -> str:
    return uuid.uuid4().hex


def response_format_wire(response_format: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` for a Pydantic model class, a JSON schema or a ready dict."""
    if response_format is None:
        return None
    if isinstance(response_format, Mapping):
        rf = dict(response_format)
        if rf.get("type") in ("text", "json_object", "json_schema"):
            return rf
        return {"type": "json_schema", "json_schema": {"name": str(rf.get("title", "response")), "schema": rf}}
    schema_fn = getattr(response_format, "model_json_schema", None)
    if callable(schema_fn):
        return {
            "type": "json_schema",
            "json_schema": {"name": getattr(response_format, "__name__", "response"), "schema": schema_fn()},
        }
    raise BadRequestError(
        f"response_format must be a Pydantic model class or a JSON schema dict, not {type(response_format).__name__}"
    )


def estimate_tokens(body: Mapping[str, Any], default_output_tokens: int) -> int:
    """Prompt tokens (about 4 characters each) plus the output budget, for rate limiting."""
    chars = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
    out = body.get("max_tokens") or body.get("max_completion_tokens") or default_output_tokens
    return max(1, chars // 4) + int(out)


def build_infer(
    *,
    model: str | None,
    prompt: str | Sequence[str] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    routing: str | None = None,
    policy: str | Policy | Mapping[str, Any] | None = None,
    accelerator_id: str | None = None,
    stream: bool = False,
    response_format: Any = None,
    defaults: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    client_timeout_s: float = 30.0,
    default_output_tokens: int = DEFAULT_MAX_TOKENS,
) -> InferCall:
    """Merge call arguments over ``defaults`` (the client's ``default_request_kwargs``) and
    build the body the gateway and the routers accept (OpenAI body plus ZML fields).

    ``extra`` holds other OpenAI parameters (``top_p``, ``stop``...) and the per-call
    ``timeout`` (seconds) and ``request_id``.
    """
    merged: dict[str, Any] = dict(defaults or {})
    merged.update(extra or {})
    explicit = {
        "model": model,
        "prompt": prompt,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "routing": routing,
        "policy": policy,
        "accelerator_id": accelerator_id,
        "response_format": response_format,
    }
    merged.update({k: v for k, v in explicit.items() if v is not None})
    timeout = merged.pop("timeout", None)
    timeout_s = float(timeout) if timeout is not None else client_timeout_s
    rf = merged.pop("response_format", None)
    asked_id = merged.pop("request_id", None)
    request_id = str(asked_id or new_request_id())
    session = merged.pop("session", None)
    if session is not None and (not isinstance(session, str) or not session.isprintable()
                                or not 0 < len(session) <= subjects.MAX_SESSION_ID):
        raise _bad_request(f"session must be printable text of 1 to {subjects.MAX_SESSION_ID} characters")
    flow = flow_fields(merged)

    if not merged.get("model"):
        raise _bad_request("model is required (pass model=... or set it on the client)")
    if merged.get("prompt") is None and merged.get("messages") is None:
        raise _bad_request("give prompt or messages")
    if merged.get("prompt") is not None and merged.get("messages") is not None:
        raise _bad_request("give prompt or messages, not both")
    kind: Kind = "chat" if merged.get("messages") is not None else "completion"
    if kind == "chat":
        merged["messages"] = [dict(m) for m in merged["messages"]]
    elif not isinstance(merged["prompt"], str):
        merged["prompt"] = list(merged["prompt"])
    merged.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    merged.setdefault("temperature", DEFAULT_TEMPERATURE)
    _policy_to_wire(merged)
    wire_rf = response_format_wire(rf)
    if wire_rf is not None:
        merged["response_format"] = wire_rf
    merged["stream"] = bool(stream)
    merged["request_id"] = request_id
    merged.setdefault("timeout_ms", max(1, int(timeout_s * 1000)))
    server_timeout_s = merged["timeout_ms"] / 1000.0
    return InferCall(
        body=merged,
        kind=kind,
        request_id=request_id,
        id_generated=not asked_id,
        timeout_s=server_timeout_s + grace_s(server_timeout_s),
        response_format=rf,
        est_tokens=estimate_tokens(merged, default_output_tokens),
        stream=bool(stream),
        session=session,
        flow=flow,
    )


#: The bands a request may name (docs/routing.md "Flow control").
PRIORITIES = ("critical", "standard", "sheddable", "batch")


def flow_fields(merged: dict[str, Any]) -> dict[str, str] | None:
    """Pop ``priority``, ``ttft_slo_ms`` and ``tpot_slo_ms`` from a call's arguments: the NATS
    headers they travel as (the router checks them; a band above the key's is lowered there)."""
    out: dict[str, str] = {}
    priority = merged.pop("priority", None)
    if priority is not None:
        if priority not in PRIORITIES:
            raise _bad_request(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        out[subjects.H_PRIORITY] = priority
    for key, header in (("ttft_slo_ms", subjects.H_TTFT_SLO_MS), ("tpot_slo_ms", subjects.H_TPOT_SLO_MS)):
        value = merged.pop(key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise _bad_request(f"{key} must be a positive number of milliseconds, got {value!r}")
        out[header] = f"{float(value):g}"
    return out or None


def _policy_to_wire(body: dict[str, Any]) -> None:
    pol = body.get("policy")
    if isinstance(pol, Policy):
        wire = msgspec.to_builtins(pol.to_wire())
        body["policy"] = {k: v for k, v in wire.items() if v is not None}
    elif isinstance(pol, Mapping):
        body["policy"] = dict(pol)


#: Of ``default_request_kwargs``, what applies to embeddings (not max_tokens, temperature...).
EMBED_DEFAULTS = ("policy", "routing", "accelerator_id", "timeout", "timeout_ms", "user", "dimensions",
                  "encoding_format")


def build_embed(
    *,
    model: str | None,
    input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
    dimensions: int | None = None,
    routing: str | None = None,
    policy: str | Policy | Mapping[str, Any] | None = None,
    accelerator_id: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    client_timeout_s: float = 30.0,
) -> InferCall:
    """The body of an embeddings request (OpenAI's plus ZML's routing fields). Vectors come
    back as floats (``encoding_format="float"``) unless ``extra`` asks for base64."""
    merged: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in EMBED_DEFAULTS}
    merged.update(extra or {})
    explicit = {"model": model, "dimensions": dimensions, "routing": routing, "policy": policy,
                "accelerator_id": accelerator_id}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    timeout = merged.pop("timeout", None)
    timeout_s = float(timeout) if timeout is not None else client_timeout_s
    asked_id = merged.pop("request_id", None)
    request_id = str(asked_id or new_request_id())
    if not merged.get("model"):
        raise _bad_request("model is required (pass model=... or set it on the client)")
    if isinstance(input, str):
        merged["input"] = input
    else:
        items: list[Any] = list(input)
        if not items:
            raise _bad_request("input is empty")
        merged["input"] = [i if isinstance(i, (str, int)) else list(i) for i in items]
    merged.setdefault("encoding_format", "float")
    _policy_to_wire(merged)
    merged["request_id"] = request_id
    merged.setdefault("timeout_ms", max(1, int(timeout_s * 1000)))
    server_timeout_s = merged["timeout_ms"] / 1000.0
    chars = sum(len(i) for i in ([input] if isinstance(input, str) else merged["input"]) if isinstance(i, str))
    return InferCall(
        body=merged, kind="embedding", request_id=request_id, id_generated=not asked_id,
        timeout_s=server_timeout_s + grace_s(server_timeout_s), est_tokens=max(1, chars // 4),
    )


def _bad_request(message: str) -> ZMLError:
    return BadRequestError(message)

