"""Replies, sans-I/O: a transport's :class:`RawReply` (status, lower-cased headers, body) decoded
into results (:class:`~zml.InferResult`, embeddings, the node and model lists) or into the
ZMLError of an error reply, with the routing metadata from the body's ``zml`` object or from the
``x-zml-*`` / ``Zml-*`` headers (:mod:`zmlcore.reply.routingmeta`).
"""

from __future__ import annotations

import base64
import json
import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from zml._core.request import InferCall
from zml._errors import BackendError, ErrorBody, ZMLError, error_class, from_wire
from zml._models import (
    Choice,
    EmbeddingResult,
    InferMeta,
    InferResult,
    Message,
    Routing,
    Usage,
)
from zmlcore import subjects
from zmlcore.messages import NodeState
from zmlcore.reply import routingmeta

__all__ = ["RawReply", "decode_embeddings", "decode_error", "decode_models", "decode_nodes", "decode_reply",
           "lower_headers", "metadata_for", "nats_status", "node_states", "parse_output", "routing_from_dict",
           "routing_from_headers"]

log = logging.getLogger("zml")

_error_decoder = msgspec.json.Decoder(ErrorBody)
_nodes_decoder = msgspec.json.Decoder(dict[str, Any])


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


def int_or(v: Any, default: int = 0) -> int:
    """``v`` as an int, or ``default`` when it is not one (a reply's fields are not trusted)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def routing_from_dict(d: Mapping[str, Any]) -> Routing:
    """The routing metadata of a reply body's ``zml`` object (or a stream's start message)."""
    return routingmeta.typed(d, Routing)


def routing_from_headers(headers: Mapping[str, str]) -> Routing | None:
    """Routing metadata from ``x-zml-*`` (HTTP), ``Zml-*`` (NATS) or ``zml-*`` (gRPC) headers,
    if present (lower-cased names; zmlcore.reply.routingmeta)."""
    return routingmeta.read(headers, Routing)


def metadata_for(routing: Routing, usage: Usage, ttft: float | None) -> InferMeta:
    return InferMeta(
        accelerator_id=routing.node_id,
        routing_policy=routing.policy,
        time_to_first_token=routing.time_to_first_token if routing.time_to_first_token is not None else ttft,
        queue_depth_at_dispatch=routing.queue_depth_at_dispatch,
        total_tokens=usage.total_tokens or (routing.total_tokens or 0),
    )


def usage_of(d: Any) -> Usage:
    """OpenAI's ``usage`` object of a reply or chunk (zeros where it is missing)."""
    if not isinstance(d, Mapping):
        return Usage()
    p, c = int_or(d.get("prompt_tokens")), int_or(d.get("completion_tokens"))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=int_or(d.get("total_tokens"), p + c))


def _reply_object(raw: RawReply, key: str) -> dict[str, Any]:
    """The JSON object of a successful reply (whose payload is under ``key``); raises the
    ZMLError of an error reply, or of an error object sent with a 200."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = msgspec.json.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"reply is not JSON: {raw.body[:200]!r}") from exc
    if not isinstance(data, dict):
        raise BackendError(f"reply is not a JSON object: {raw.body[:200]!r}")
    if "error" in data and key not in data:
        raise decode_error(RawReply(status=500, headers=raw.headers, body=raw.body))
    return data


def _routing_of(data: Mapping[str, Any], headers: Mapping[str, str]) -> Routing:
    """A reply's routing metadata: its ``zml`` object, else its headers, else empty."""
    zml = data.get("zml")
    return routing_from_dict(zml) if isinstance(zml, Mapping) else (routing_from_headers(headers) or Routing())


def decode_reply(raw: RawReply, call: InferCall) -> InferResult:
    """The result of a non-streaming reply; raises the ZMLError of an error reply."""
    data = _reply_object(raw, "choices")
    choices: list[Choice] = []
    for i, ch in enumerate(data.get("choices") or ()):
        if not isinstance(ch, Mapping):
            continue
        msg = ch.get("message") if isinstance(ch.get("message"), Mapping) else None
        content = (msg or {}).get("content") if msg is not None else ch.get("text")
        text = content if isinstance(content, str) else ""
        choices.append(Choice(
            index=int_or(ch.get("index"), i),
            message=Message(role=str((msg or {}).get("role", "assistant")), content=text),
            text=text,
            finish_reason=ch.get("finish_reason"),
        ))
    routing = _routing_of(data, raw.headers)
    usage = usage_of(data.get("usage"))
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


def _vector(v: Any) -> list[float]:
    if isinstance(v, str):  # encoding_format="base64": little-endian float32
        raw = base64.b64decode(v)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if isinstance(v, list):
        return [float(x) for x in v]
    raise BackendError(f"embedding is neither a list nor base64: {str(v)[:100]}")


def decode_embeddings(raw: RawReply, call: InferCall) -> EmbeddingResult:
    """The result of an embeddings reply; raises the ZMLError of an error reply."""
    data = _reply_object(raw, "data")
    if not isinstance(data.get("data"), list):
        raise BackendError(f"reply is not an embeddings list: {raw.body[:200]!r}")
    items = sorted((d for d in data["data"] if isinstance(d, Mapping)), key=lambda d: int_or(d.get("index")))
    routing = _routing_of(data, raw.headers)
    usage = usage_of(data.get("usage"))
    return EmbeddingResult(
        embeddings=[_vector(d.get("embedding")) for d in items],
        routing=routing,
        metadata=metadata_for(routing, usage, None),
        usage=usage,
        model=str(data.get("model", call.body.get("model", ""))),
        raw=data,
    )


def _list_object(raw: RawReply, what: str) -> dict[str, Any]:
    """The JSON object of a node or model list; raises the ZMLError of an error reply."""
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        return _nodes_decoder.decode(raw.body)
    except msgspec.DecodeError as exc:
        raise BackendError(f"{what} is not JSON: {raw.body[:200]!r}") from exc


def decode_nodes(raw: RawReply) -> list[dict[str, Any]]:
    """The ``nodes`` list of ``GET /v1/nodes`` / ``zml.admin.nodes.list`` as dicts."""
    nodes = _list_object(raw, "node list").get("nodes")
    return [n for n in nodes if isinstance(n, dict)] if isinstance(nodes, list) else []


def node_states(nodes: Sequence[Mapping[str, Any]]) -> list[NodeState]:
    return [msgspec.convert(dict(n), NodeState) for n in nodes]


def decode_models(raw: RawReply) -> list[str]:
    """Model ids from ``GET /v1/models`` (OpenAI list) or from a node list (NATS)."""
    data = _list_object(raw, "model list")
    if isinstance(data.get("data"), list):
        return [str(m["id"]) for m in data["data"] if isinstance(m, dict) and "id" in m]
    seen: dict[str, None] = {}
    for n in decode_nodes(raw):
        for m in n.get("models") or ():
            seen.setdefault(str(m), None)
    return list(seen)

