"""The sans-I/O core shared by ``Client`` and ``AsyncClient`` and by both transports.

Builds request bodies, decodes replies, stream events and errors, and decides retries. No
sockets, no clocks, no sleeping here: the clients and transports do the I/O and pass time and
randomness in, so every decision is unit-testable without a server.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from zml._errors import (
    BackendError,
    BadRequestError,
    ErrorBody,
    StreamInterruptedError,
    TimeoutError,
    ZMLError,
    error_class,
    from_wire,
)
from zml._models import (
    Choice,
    EmbeddingResult,
    InferMeta,
    InferResult,
    Message,
    Policy,
    Routing,
    StreamChunk,
    Usage,
)
from zmlcore import subjects
from zmlcore.reply import routingmeta
from zmlcore.reply import streamframe
from zmlcore.config import NatsConfig, ZMLConfig
from zmlcore.messages import NodeState
from zmlcore.reply.sse import SSELineSplitter, data_field
from zmlcore.reply.streamseq import SeqCheck

log = logging.getLogger("zml")

DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.7
#: Backoff ceiling and Retry-After cap (seconds).
MAX_BACKOFF_S = 60.0
MAX_JITTER_S = 0.5
#: At most this many extra seconds the client waits beyond the request's server-side timeout,
#: so the server's TIMEOUT error (with its routing context) arrives before the client gives up.
TIMEOUT_GRACE_S = 2.0


def grace_s(timeout_s: float) -> float:
    """The client's extra wait beyond a server-side timeout of ``timeout_s``."""
    return min(TIMEOUT_GRACE_S, 0.25 + 0.1 * timeout_s)

Kind = Literal["chat", "completion", "embedding"]
_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}

_json_encoder = msgspec.json.Encoder()
_error_decoder = msgspec.json.Decoder(ErrorBody)
_nodes_decoder = msgspec.json.Decoder(dict[str, Any])


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


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

    def encode(self) -> bytes:
        return _json_encoder.encode(self.body)

    @property
    def http_path(self) -> str:
        return _PATHS[self.kind]

    def http_headers(self) -> dict[str, str]:
        """Tells the gateway the id is the SDK's own (no cross-replica duplicate check needed)."""
        return {H_HTTP_ID_GENERATED: "1"} if self.id_generated else {}

    def nats_headers(self) -> dict[str, str]:
        return {
            subjects.H_REQUEST_ID: self.request_id,
            subjects.H_TIMEOUT_MS: str(int(self.body.get("timeout_ms") or self.timeout_s * 1000)),
            **({subjects.H_ID_GENERATED: "1"} if self.id_generated else {}),
            # A stream's chunks as header-less frames: no header block to build or parse per
            # chunk (zmlcore.reply.streamframe; decoded by decode_nats_frame).
            **({subjects.H_ACCEPT_STREAM: subjects.STREAM_FRAMES} if self.stream else {}),
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


def parse_output(text: str, response_format: Any) -> Any:
    """Parse ``text`` per ``response_format``; None plus a logged warning when it fails."""
    if response_format is None:
        return None
    try:
        validate = getattr(response_format, "model_validate_json", None)
        if callable(validate):
            return validate(_strip_fences(text))
        return json.loads(_strip_fences(text))
    except Exception as exc:  # pydantic.ValidationError, ValueError: any parse failure
        log.warning("zml: could not parse the output as %s: %s", _rf_name(response_format), exc)
        return None


def _rf_name(response_format: Any) -> str:
    return str(getattr(response_format, "__name__", "JSON"))


def _strip_fences(text: str) -> str:
    t = text.strip()
    if t.startswith("```"):
        t = t.split("\n", 1)[1] if "\n" in t else ""
        if t.rstrip().endswith("```"):
            t = t.rstrip()[:-3]
    return t


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
    )


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


def _vector(v: Any) -> list[float]:
    if isinstance(v, str):  # encoding_format="base64": little-endian float32
        raw = base64.b64decode(v)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if isinstance(v, list):
        return [float(x) for x in v]
    raise BackendError(f"embedding is neither a list nor base64: {str(v)[:100]}")


def decode_embeddings(raw: RawReply, call: InferCall) -> EmbeddingResult:
    """The result of an embeddings reply; raises the ZMLError of an error reply."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = msgspec.json.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"reply is not JSON: {raw.body[:200]!r}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        if isinstance(data, dict) and "error" in data:
            raise decode_error(RawReply(status=500, headers=raw.headers, body=raw.body))
        raise BackendError(f"reply is not an embeddings list: {raw.body[:200]!r}")
    items = sorted((d for d in data["data"] if isinstance(d, Mapping)), key=lambda d: _int(d.get("index")))
    zml = data.get("zml")
    routing = routing_from_dict(zml) if isinstance(zml, Mapping) else (routing_from_headers(raw.headers) or Routing())
    usage = _usage(data.get("usage"))
    return EmbeddingResult(
        embeddings=[_vector(d.get("embedding")) for d in items],
        routing=routing,
        metadata=metadata_for(routing, usage, None),
        usage=usage,
        model=str(data.get("model", call.body.get("model", ""))),
        raw=data,
    )


def _bad_request(message: str) -> ZMLError:
    return BadRequestError(message)


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RawReply:
    """A reply as a transport received it. NATS replies get the status of their error code.
    ``headers`` keys are lower-case."""

    status: int
    headers: dict[str, str]
    body: bytes


def lower_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {k.lower(): v for k, v in (headers or {}).items()}


def nats_status(headers: Mapping[str, str]) -> int:
    """HTTP-equivalent status of a NATS reply (200, or the status of its error code)."""
    code = headers.get(subjects.H_ERROR_CODE.lower())
    return error_class(code).http_status if code else 200


def _retry_after_header(headers: Mapping[str, str]) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def decode_error(raw: RawReply) -> ZMLError:
    """The exception for an error reply (ErrorBody JSON, else the status alone)."""
    retry_after = _retry_after_header(raw.headers)
    try:
        body = _error_decoder.decode(raw.body)
    except msgspec.DecodeError:
        cls = _class_for_status(raw.status)
        text = raw.body.decode("utf-8", "replace").strip()[:200]
        return cls(f"HTTP {raw.status}: {text}" if text else f"HTTP {raw.status}", retry_after=retry_after)
    exc = from_wire(body.error)
    if exc.retry_after is None:
        exc.retry_after = retry_after
    return exc


def _class_for_status(status: int) -> type[ZMLError]:
    by_status = {400: "BAD_REQUEST", 401: "AUTH_FAILED", 403: "AUTH_FAILED", 404: "MODEL_NOT_LOADED",
                 408: "TIMEOUT", 429: "RATE_LIMITED", 502: "BACKEND_ERROR", 503: "NO_HEALTHY_NODES",
                 504: "TIMEOUT"}
    if status in by_status:
        return error_class(by_status[status])
    return error_class("BACKEND_ERROR") if status >= 500 else error_class("BAD_REQUEST")


def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _float_or_none(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def routing_from_dict(d: Mapping[str, Any]) -> Routing:
    return Routing(
        node_id=str(d.get("node_id", "")),
        accelerator_type=str(d.get("accelerator_type", "")),
        family=str(d.get("family", "")),
        policy=str(d.get("policy", "")),
        queue_depth_at_dispatch=_int(d.get("queue_depth_at_dispatch")),
        decision_id=str(d.get("decision_id", "")),
        request_id=str(d.get("request_id", "")),
        attempts=_int(d.get("attempts"), 1),
        time_to_first_token=_float_or_none(d.get("time_to_first_token")),
        total_tokens=None if d.get("total_tokens") is None else _int(d.get("total_tokens")),
    )


def routing_from_headers(headers: Mapping[str, str]) -> Routing | None:
    """Routing metadata from ``x-zml-*`` (HTTP) or ``zml-*`` (NATS) headers, if present
    (lower-cased names; the map is zmlcore.reply.routingmeta's)."""
    got = routingmeta.read(headers)
    if got is None:
        return None
    return Routing(
        node_id=got["node_id"],
        accelerator_type=got.get("accelerator_type", ""),
        family=got.get("family", ""),
        policy=got.get("policy", ""),
        queue_depth_at_dispatch=_int(got.get("queue_depth_at_dispatch")),
        decision_id=got.get("decision_id", ""),
        request_id=got.get("request_id", ""),
    )


def metadata_for(routing: Routing, usage: Usage, ttft: float | None) -> InferMeta:
    return InferMeta(
        accelerator_id=routing.node_id,
        routing_policy=routing.policy,
        time_to_first_token=routing.time_to_first_token if routing.time_to_first_token is not None else ttft,
        queue_depth_at_dispatch=routing.queue_depth_at_dispatch,
        total_tokens=usage.total_tokens or (routing.total_tokens or 0),
    )


def _usage(d: Any) -> Usage:
    if not isinstance(d, Mapping):
        return Usage()
    p, c = _int(d.get("prompt_tokens")), _int(d.get("completion_tokens"))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=_int(d.get("total_tokens"), p + c))


def decode_reply(raw: RawReply, call: InferCall) -> InferResult:
    """The result of a non-streaming reply; raises the ZMLError of an error reply."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = msgspec.json.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"reply is not JSON: {raw.body[:200]!r}") from exc
    if not isinstance(data, dict):
        raise BackendError(f"reply is not a JSON object: {raw.body[:200]!r}")
    if "error" in data and "choices" not in data:
        raise decode_error(RawReply(status=500, headers=raw.headers, body=raw.body))
    choices: list[Choice] = []
    for i, ch in enumerate(data.get("choices") or ()):
        if not isinstance(ch, Mapping):
            continue
        msg = ch.get("message") if isinstance(ch.get("message"), Mapping) else None
        content = (msg or {}).get("content") if msg is not None else ch.get("text")
        text = content if isinstance(content, str) else ""
        choices.append(Choice(
            index=_int(ch.get("index"), i),
            message=Message(role=str((msg or {}).get("role", "assistant")), content=text),
            text=text,
            finish_reason=ch.get("finish_reason"),
        ))
    zml = data.get("zml")
    routing = routing_from_dict(zml) if isinstance(zml, Mapping) else (routing_from_headers(raw.headers) or Routing())
    usage = _usage(data.get("usage"))
    text = choices[0].text if choices else ""
    return InferResult(
        text=text,
        choices=choices,
        routing=routing,
        metadata=metadata_for(routing, usage, None),
        usage=usage,
        id=str(data.get("id", "")),
        model=str(data.get("model", call.body.get("model", ""))),
        output_parsed=parse_output(text, call.response_format),
        raw=data,
    )


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamEvent:
    kind: Literal["start", "chunk", "end", "error"]
    chunk: StreamChunk | None = None
    routing: Routing | None = None
    error: ZMLError | None = None
    usage: Usage | None = None


def decode_chunk(data: Any) -> StreamEvent:
    """One OpenAI chunk (chat ``delta.content`` or completions ``text``)."""
    if not isinstance(data, dict):
        return StreamEvent("chunk", chunk=StreamChunk(text=""))
    if "error" in data and "choices" not in data:
        return StreamEvent("error", error=_error_from_obj(data))
    text, index, finish = "", 0, None
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], Mapping):
        ch = choices[0]
        delta = ch.get("delta")
        piece = delta.get("content") if isinstance(delta, Mapping) else ch.get("text")
        text = piece if isinstance(piece, str) else ""
        index, finish = _int(ch.get("index")), ch.get("finish_reason")
    usage = _usage(data["usage"]) if isinstance(data.get("usage"), Mapping) else None
    return StreamEvent("chunk", chunk=StreamChunk(text=text, index=index, finish_reason=finish, raw=data), usage=usage)


def _error_from_obj(data: Mapping[str, Any]) -> ZMLError:
    try:
        return from_wire(msgspec.convert(data, ErrorBody).error)
    except msgspec.ValidationError:
        return BackendError(f"stream error: {json.dumps(data)[:200]}")


@dataclass
class SSEDecoder:
    """Turns the gateway's SSE lines into stream events. Feed one line at a time."""

    done: bool = False
    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> StreamEvent | None:
        line = line.rstrip("\r\n")
        if line.startswith("data:"):
            self._data.append(line[5:].lstrip(" "))
            # The gateway sends one JSON object per data line: decode without waiting for "".
            return self._flush()
        if line == "":
            return self._flush()
        return None  # comments (": keep-alive"), event:, id:

    def _flush(self) -> StreamEvent | None:
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data.clear()
        if payload.strip() == "[DONE]":
            self.done = True
            return StreamEvent("end")
        try:
            data = json.loads(payload)
        except ValueError:
            return StreamEvent("error", error=BackendError(f"bad stream data: {payload[:200]}"))
        return decode_chunk(data)


def decode_nats_stream(headers: Mapping[str, str], body: bytes) -> StreamEvent:
    """One message of a NATS streamed reply (``Zml-Stream`` header; keys lower-case)."""
    if headers.get("status") == "503":
        return StreamEvent("error", error=no_router_error())
    kind = headers.get(subjects.H_STREAM.lower())
    code = headers.get(subjects.H_ERROR_CODE.lower())
    if kind == subjects.STREAM_ERROR or (code and kind is None):
        return StreamEvent("error", error=decode_error(RawReply(status=nats_status(headers), headers=dict(headers), body=body)))
    try:
        data = msgspec.json.decode(body) if body else {}
    except msgspec.DecodeError:
        return StreamEvent("error", error=BackendError(f"bad stream message: {body[:200]!r}"))
    if kind in ("start", subjects.STREAM_END):
        r = data.get("routing") if isinstance(data, dict) else None
        routing = routing_from_dict(r) if isinstance(r, Mapping) else None
        return StreamEvent("start" if kind == "start" else "end", routing=routing)
    return decode_chunk(data)


def decode_nats_frame(data: bytes, seq: SeqCheck) -> list[StreamEvent]:
    """The chunk events of one header-less stream frame (``Zml-Accept-Stream: frames``: the
    sequence number, a newline, whole SSE events; zmlcore.reply.streamframe). Ends with an error event
    (and nothing after it) for a message that is not a frame (BACKEND_ERROR), a lost message
    (STREAM_INTERRUPTED), bad JSON or an error object from the node."""
    try:
        n, events = streamframe.decode(data)
    except streamframe.FrameError as exc:
        return [StreamEvent("error", error=BackendError(
            f"the router sent a garbled stream message ({exc}); the stream is incomplete"))]
    gap = seq.gap_n(n)
    if gap is not None:
        return [StreamEvent("error", error=StreamInterruptedError(f"{gap}; the stream is incomplete"))]
    out: list[StreamEvent] = []
    split = SSELineSplitter()
    for line in split.feed(events) + split.flush():
        value = data_field(line)
        if not value or value.strip() == b"[DONE]":  # blank lines between events; [DONE] is never sent
            continue
        try:
            ev = decode_chunk(msgspec.json.decode(value))
        except msgspec.DecodeError:
            ev = StreamEvent("error", error=BackendError(f"bad stream data: {value[:200]!r}"))
        out.append(ev)
        if ev.kind == "error":
            break
    return out


def no_router_error(subject: str = subjects.INFER) -> ZMLError:
    """What a NATS "no responders" status means: nothing serves ``subject``."""
    who = "ZML router" if subject == subjects.INFER else "ZML service"
    return error_class("NO_HEALTHY_NODES")(
        f"no {who} answers on NATS subject {subject!r}: start ZML with `zml up` or check the nats:// endpoint",
        retry_after=1.0,
    )


# --------------------------------------------------------------------------------------------
# Retries
# --------------------------------------------------------------------------------------------


def is_retryable(exc: BaseException) -> bool:
    """Transient: 429, 503 (QUEUE_FULL, NO_HEALTHY_NODES), 5xx, network, timeout."""
    return isinstance(exc, ZMLError) and bool(exc.retryable)


def retry_delay(exc: BaseException, retries_done: int, max_retries: int, jitter: float) -> float | None:
    """Seconds to wait before the next attempt, or None to give up and raise ``exc``.

    ``min(2**retries_done, 60)`` plus ``jitter`` (0..1, scaled to at most 0.5 s); a
    ``Retry-After`` from the server replaces it (capped at 60 s).
    """
    if retries_done >= max_retries or not is_retryable(exc):
        return None
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        return min(max(0.0, float(retry_after)), MAX_BACKOFF_S)
    return min(2.0**retries_done, MAX_BACKOFF_S) + max(0.0, min(1.0, jitter)) * MAX_JITTER_S


def timeout_error(timeout_s: float, request_id: str) -> ZMLError:
    return TimeoutError(
        f"no reply within {timeout_s:.1f}s (request {request_id}). Increase timeout or reduce prompt length."
    )


# --------------------------------------------------------------------------------------------
# Nodes
# --------------------------------------------------------------------------------------------


def decode_nodes(raw: RawReply) -> list[dict[str, Any]]:
    """The ``nodes`` list of ``GET /v1/nodes`` / ``zml.admin.nodes.list`` as dicts."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = _nodes_decoder.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"node list is not JSON: {raw.body[:200]!r}") from exc
    nodes = data.get("nodes")
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []


def node_states(nodes: Sequence[Mapping[str, Any]]) -> list[NodeState]:
    return [msgspec.convert(dict(n), NodeState) for n in nodes]


def decode_models(raw: RawReply) -> list[str]:
    """Model ids from ``GET /v1/models`` (OpenAI list) or from a node list (NATS)."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = _nodes_decoder.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"model list is not JSON: {raw.body[:200]!r}") from exc
    if isinstance(data.get("data"), list):
        return [str(m["id"]) for m in data["data"] if isinstance(m, dict) and "id" in m]
    seen: dict[str, None] = {}
    for n in decode_nodes(raw):
        for m in n.get("models") or ():
            seen.setdefault(str(m), None)
    return list(seen)


class ClientSettings:
    """What ``Client`` and ``AsyncClient`` configure identically (no I/O): endpoint and key
    resolution, retry and batch settings, request defaults and the rate limiter."""

    endpoint: str
    api_key: str | None
    config: ZMLConfig | None

    def _configure(
        self,
        endpoint: str | None,
        api_key: str | None,
        timeout: float,
        max_connections: int,
        config_path: str | os.PathLike[str] | None,
        model: str | None,
        max_retries: int,
        max_parallel_requests: int | None,
        limits: Mapping[str, Any],
        default_output_tokens: int,
        default_request_kwargs: Mapping[str, Any] | None,
    ) -> int:
        """Set the shared attributes; returns the connection pool size for the transport."""
        from zml._config import resolve
        from zml._ratelimit import RateLimiter

        settings = resolve(endpoint, api_key, config_path)
        self.endpoint = settings.endpoint
        self.api_key = settings.api_key
        self.config = settings.config
        self.timeout = float(timeout)
        self.model = model
        self.max_retries = max(0, int(max_retries))
        self.max_parallel_requests = int(max_parallel_requests or max_connections)
        self.default_output_tokens = int(default_output_tokens)
        self.default_request_kwargs: dict[str, Any] = dict(default_request_kwargs or {})
        self._limiter = RateLimiter(**limits, now=time.monotonic())
        return max(int(max_connections), self.max_parallel_requests)

    def nats_config(self) -> NatsConfig:
        """NATS identity and TLS for a nats:// endpoint: zml.toml's ``[nats]`` (or the defaults)
        with the environment's overrides (ZML_NATS_NKEY, ZML_NATS_TLS_*)."""
        from zmlcore.config import load_config

        base = self.config.nats if self.config is not None else load_config(None).nats
        return msgspec.structs.replace(base, url=self.endpoint)
