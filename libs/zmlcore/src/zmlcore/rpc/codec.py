"""zml.v1 messages <-> ZML's JSON bodies (pure).

The gateway turns an :class:`InferRequest` into the JSON body POST /v1/chat/completions takes
(:func:`request_body`) and a JSON reply or stream chunk into an :class:`InferReply` /
:class:`InferChunk`; the SDK goes the other way (:func:`request_from_body`). Each message
keeps the JSON it came from (``json``), so nothing a backend sends is lost.

    path, body = request_body(req, stream=False, max_depth=32)     # gateway
    req = request_from_body(call.body)                              # SDK

ZML codes and gRPC statuses: :mod:`zmlcore.rpc.status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from zmlcore.errors import BadRequestError
from zmlcore.rpc import zml_pb2 as pb
from zmlcore.messages import RoutingInfo
from zmlcore.messages.validate import clip, deeper_than

__all__ = ["chunk_from_json", "models_from_json", "nodes_from_json", "reply_from_json", "request_body",
           "request_from_body", "routing_message"]

# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

_PATHS = {"messages": "/v1/chat/completions", "prompt": "/v1/completions", "input": "/v1/embeddings"}
_POLICY_FIELDS = ("latency_target_ms", "latency_weight", "cost_weight", "queue_threshold",
                  "queue_on_saturation", "max_queue_ms")
_encode = msgspec.json.encode


def _policy(p: pb.Policy) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("name", "strategy", "cost_priority"):
        value = getattr(p, name)
        if value:
            out[name] = value
    if p.accelerator_chain:
        out["accelerator_chain"] = list(p.accelerator_chain)
    for name in _POLICY_FIELDS:
        if p.HasField(name):
            out[name] = getattr(p, name)
    return out


def request_body(req: pb.InferRequest, *, stream: bool, max_depth: int = 32,
                 timeout_cap_ms: int | None = None) -> tuple[str, bytes]:
    """The HTTP path and JSON body of ``req`` (what POST on that path takes). ``extra_json``
    keys join the body; one that repeats a field set in the message is a BadRequestError.
    ``timeout_cap_ms`` (the call's gRPC deadline) lowers the request's timeout."""
    body: dict[str, Any] = {"model": req.model}
    if req.messages:
        body["messages"] = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                            for m in req.messages]
    if req.prompt and req.prompts:
        raise BadRequestError("give `prompt` or `prompts`, not both")
    if req.prompt or req.prompts:
        body["prompt"] = req.prompt or list(req.prompts)
    if req.HasField("max_tokens"):
        body["max_tokens"] = req.max_tokens
    if req.HasField("temperature"):
        body["temperature"] = req.temperature
    if req.policy and req.HasField("inline_policy"):
        raise BadRequestError("give `policy` (a name) or `inline_policy`, not both")
    if req.policy:
        body["policy"] = req.policy
    elif req.HasField("inline_policy"):
        body["policy"] = _policy(req.inline_policy)
    for name in ("routing", "accelerator_id", "request_id"):
        value = getattr(req, name)
        if value:
            body[name] = value
    if req.HasField("timeout_ms"):
        body["timeout_ms"] = req.timeout_ms
    if req.extra_json:
        if deeper_than(req.extra_json, max_depth):
            raise BadRequestError(f"extra_json nested deeper than {max_depth} levels")
        try:
            extra = msgspec.json.decode(req.extra_json)
        except msgspec.DecodeError as exc:
            raise BadRequestError(f"extra_json is not JSON: {clip(str(exc), 200)[1:-1]}") from None
        if not isinstance(extra, dict):
            raise BadRequestError("extra_json must be a JSON object")
        for key, value in extra.items():
            if key == "stream":
                raise BadRequestError("`stream` is chosen by the method (Infer or InferStream), not extra_json")
            if key in body and not (key == "model" and not req.model):
                raise BadRequestError(f"extra_json repeats the field {clip(key, 40)}")
            body[key] = value
    if timeout_cap_ms is not None:
        asked = body.get("timeout_ms")
        body["timeout_ms"] = max(1, min(asked, timeout_cap_ms) if isinstance(asked, int) and asked > 0
                                 else timeout_cap_ms)
    if stream:
        body["stream"] = True
    path = next((p for key, p in _PATHS.items() if key in body), _PATHS["messages"])
    return path, _encode(body)


def _simple_message(m: Any) -> bool:
    return (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and isinstance(m.get("name", ""), str) and set(m) <= {"role", "content", "name"})


def _inline_policy(p: Mapping[str, Any]) -> pb.Policy | None:
    out = pb.Policy()
    try:
        for key, value in p.items():
            if key in ("name", "strategy", "cost_priority") and isinstance(value, str):
                setattr(out, key, value)
            elif key == "accelerator_chain" and isinstance(value, list):
                out.accelerator_chain.extend(value)
            elif key in _POLICY_FIELDS and value is not None and not isinstance(value, (dict, list, str)):
                setattr(out, key, value)
            else:
                return None
    except (TypeError, ValueError):
        return None
    return out


def request_from_body(body: Mapping[str, Any]) -> pb.InferRequest:
    """The :class:`InferRequest` of a JSON body (the SDK's): typed fields where the value fits
    one, everything else (and ``stream``, which the method carries) in ``extra_json``."""
    req = pb.InferRequest()
    extra: dict[str, Any] = {}
    for key, value in body.items():
        if value is None or key == "stream":
            continue
        if key == "model" and isinstance(value, str):
            req.model = value
        elif key == "messages" and isinstance(value, list) and value and all(_simple_message(m) for m in value):
            req.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"], name=m.get("name", ""))
                                for m in value)
        elif key == "prompt" and isinstance(value, str) and value:
            req.prompt = value
        elif key == "prompt" and isinstance(value, list) and value and all(isinstance(p, str) and p for p in value):
            req.prompts.extend(value)
        elif key in ("max_tokens", "timeout_ms") and type(value) is int and 0 <= value < 2**32:
            setattr(req, key, value)
        elif key == "temperature" and type(value) in (int, float):
            req.temperature = float(value)
        elif key in ("routing", "accelerator_id", "request_id") and isinstance(value, str) and value:
            setattr(req, key, value)
        elif key == "policy" and isinstance(value, str) and value:
            req.policy = value
        elif key == "policy" and isinstance(value, Mapping) and (pol := _inline_policy(value)) is not None:
            req.inline_policy.CopyFrom(pol)
        else:
            extra[key] = value
    if extra:
        req.extra_json = _encode(extra)
    return req


# --------------------------------------------------------------------------------------------
# Replies
# --------------------------------------------------------------------------------------------


class _Msg(msgspec.Struct):
    role: str = "assistant"
    content: Any = None


class _Choice(msgspec.Struct):
    index: int = 0
    message: _Msg | None = None
    delta: _Msg | None = None
    text: Any = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _Reply(msgspec.Struct):
    id: str = ""
    model: str = ""
    choices: list[_Choice] = []
    usage: _Usage | None = None
    zml: RoutingInfo | None = None


_reply_decoder = msgspec.json.Decoder(_Reply)


def _u32(n: int) -> int:
    return n if 0 <= n < 2**32 else 0


def _usage(u: _Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=_u32(u.prompt_tokens), completion_tokens=_u32(u.completion_tokens),
                    total_tokens=_u32(u.total_tokens))


def _text(ch: _Choice) -> tuple[str, str]:
    part = ch.message if ch.message is not None else ch.delta
    content = part.content if part is not None else ch.text
    return (content if isinstance(content, str) else ""), (part.role if part is not None else "")


def reply_from_json(data: bytes) -> pb.InferReply:
    """The reply message of a JSON reply body; a body of another shape travels in ``json`` only."""
    out = pb.InferReply(json=data)
    try:
        r = _reply_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return out
    out.id, out.model = r.id, r.model
    for ch in r.choices:
        text, role = _text(ch)
        out.choices.add(index=_u32(ch.index), text=text, role=role, finish_reason=ch.finish_reason or "")
    if r.usage is not None:
        out.usage.CopyFrom(_usage(r.usage))
    if r.zml is not None:
        out.routing.CopyFrom(routing_message(r.zml))
    return out


_UINT32 = frozenset(f.name for f in pb.Routing.DESCRIPTOR.fields if f.type == f.TYPE_UINT32)


def routing_message(info: RoutingInfo) -> pb.Routing:
    """zml.v1 ``Routing`` of ``info``: field by field, by name (proto/generate.py writes the
    message from RoutingInfo); a None field stays unset."""
    out = pb.Routing()
    for name in RoutingInfo.__struct_fields__:
        value = getattr(info, name)
        if value is not None:
            setattr(out, name, _u32(value) if name in _UINT32 else value)
    return out


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def chunk_from_json(data: bytes) -> pb.InferChunk:
    """The stream message of one OpenAI chunk (its first choice; all of it in ``json``)."""
    out = pb.InferChunk(json=data)
    try:
        c = _chunk_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return out
    if c.choices:
        ch = c.choices[0]
        out.text = _text(ch)[0]
        out.index = _u32(ch.index)
        out.finish_reason = ch.finish_reason or ""
    if c.usage is not None:
        out.usage.CopyFrom(_usage(c.usage))
    return out


# --------------------------------------------------------------------------------------------
# Fleet
# --------------------------------------------------------------------------------------------


class _ModelObj(msgspec.Struct):
    id: str = ""
    zml: dict[str, Any] | None = None


class _Models(msgspec.Struct):
    data: list[_ModelObj] = []


class _NodeRow(msgspec.Struct):
    node_id: str = ""
    accelerator_type: str = ""
    family: str = ""
    status: str = ""
    models: list[str] = []
    in_flight: int = 0
    cost_per_hour: float = 0.0


class _Nodes(msgspec.Struct):
    nodes: list[_NodeRow] = []


def models_from_json(data: bytes) -> pb.ListModelsReply:
    """ListModels' reply from GET /v1/models's body."""
    out = pb.ListModelsReply(json=data)
    try:
        models = msgspec.json.decode(data, type=_Models)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return out
    for m in models.data:
        up = (m.zml or {}).get("nodes_up")
        out.models.add(id=m.id, nodes_up=[n for n in up if isinstance(n, str)] if isinstance(up, list) else [])
    return out


def nodes_from_json(data: bytes) -> pb.ListNodesReply:
    """ListNodes' reply from GET /v1/nodes's body."""
    out = pb.ListNodesReply(json=data)
    try:
        nodes = msgspec.json.decode(data, type=_Nodes)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return out
    for n in nodes.nodes:
        out.nodes.add(node_id=n.node_id, accelerator_type=n.accelerator_type, family=n.family, status=n.status,
                      models=n.models, in_flight=_u32(n.in_flight), cost_per_hour=n.cost_per_hour)
    return out
