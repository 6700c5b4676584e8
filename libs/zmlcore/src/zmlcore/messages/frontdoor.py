"""The gateway -> router request codec: the body parsed once on each side, forwarded untouched.

The gateway validates a request with :func:`zmlcore.messages.validate.decode_request` (the full check
a raw ``zml.infer`` request gets in the router). It then sends the router, on the front-door
subject, the caller's bytes with ZML's own fields (``policy``/``routing``, ``accelerator_id``,
``request_id``, ``timeout_ms``) moved into headers (:func:`split`): a body without them (an
OpenAI client's) is not re-encoded at all; the SDK's is rewritten once, here. The router then
decodes only what routing needs (:func:`decode`: the heavy ``messages``/``prompt`` stay raw
bytes) and, when no model name changes, hands the node the very bytes it received.

Raw NATS clients keep sending the documented JSON on ``zml.infer``; these headers are honoured
only on the front-door subject (zml_router.request.intake.drop_untrusted drops them elsewhere), so a raw client cannot
skip validation or set a field through a header it could not set in the body.

    body, extra = split(raw, req)          # gateway: headers |= extra, send body
    req = decode(body, headers, max_depth) # router, when headers[H_BODY] == BODY_CLEAN
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.structs

from zmlcore import subjects
from zmlcore.errors import BadRequestError
from zmlcore.messages import ZML_REQUEST_KEYS, InferRequest, InlinePolicy
from zmlcore.messages.validate import MAX_MODEL_NAME, clip, deeper_than

__all__ = ["FrontDoorRequest", "continue_asked", "decode", "split", "has_zml_keys", "drop_zml_keys"]

#: Which of ZML's keys a body has (null or not): a typed decode that skips the rest, ~2.5 µs for
#: an 8 KB chat where six ``in`` byte searches took ~19 µs.
_Present = msgspec.defstruct("_Present", [(k, msgspec.Raw, msgspec.UNSET) for k in ZML_REQUEST_KEYS])
_present = msgspec.json.Decoder(_Present)
_absent = (msgspec.UNSET,) * len(ZML_REQUEST_KEYS)
_astuple = msgspec.structs.astuple
_decode_any = msgspec.json.Decoder()
_encode = msgspec.json.encode
_encode_field = msgspec.json.encode  # a header's value (apart: tests count body encodes)
_policy = msgspec.json.Decoder(str | InlinePolicy)


def has_zml_keys(raw: bytes) -> bool:
    """Whether the JSON object ``raw`` (already validated) has one of ZML's own keys at its top level."""
    return _astuple(_present.decode(raw)) != _absent  # (all read in one C call: no getattr per key)


def drop_zml_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a decoded body) without ZML's own fields, in place: what a node must not see."""
    for key in ZML_REQUEST_KEYS:
        data.pop(key, None)
    return data


def split(raw: bytes, req: InferRequest) -> tuple[bytes, dict[str, str]]:
    """The body without ZML's own fields and the headers that carry them instead (``req`` is
    ``raw`` decoded and validated). ``raw`` itself when it has none of them."""
    headers = {subjects.H_BODY: subjects.BODY_CLEAN}
    policy: Any = req.policy if req.policy is not None else req.routing
    if policy is not None:
        if isinstance(policy, InlinePolicy):  # only what the caller set: a short header
            policy = {k: v for k, v in msgspec.structs.asdict(policy).items() if v is not None}
        headers[subjects.H_POLICY] = _encode_field(policy).decode()
    if req.accelerator_id is not None:
        headers[subjects.H_ACCELERATOR_ID] = req.accelerator_id
    if req.continue_on_failure is not None:
        headers[subjects.H_CONTINUE] = "1" if req.continue_on_failure else "0"
    given = (policy is not None or req.accelerator_id is not None or req.request_id is not None
             or req.timeout_ms is not None or req.continue_on_failure is not None)
    if not given and not has_zml_keys(raw):  # else a ``null`` field, or ``zml``
        return raw, headers
    return _encode(drop_zml_keys(_decode_any.decode(raw))), headers  # valid: decode_request read it


class FrontDoorRequest(InferRequest, kw_only=True):
    """An :class:`InferRequest` the gateway validated: the prompt is kept as raw JSON (routing
    needs only its presence and the body's size), so the router's decode is small."""

    # msgspec takes no Raw in a union: a field absent is None, ``null`` is made None below.
    messages: msgspec.Raw = None  # type: ignore[assignment]
    prompt: msgspec.Raw = None  # type: ignore[assignment]


_front_door = msgspec.json.Decoder(FrontDoorRequest)


def decode(raw: bytes, headers: dict[str, str], *, max_depth: int = 32) -> FrontDoorRequest:
    """The router's decode of a front-door body (``Zml-Body: clean``) and its ZML headers.
    Bounded like :func:`zmlcore.messages.validate.decode_request` (an open broker lets anyone publish
    on the front door): bad input is a BadRequestError, never a crash."""
    if deeper_than(raw, max_depth):
        raise BadRequestError(f"JSON nested deeper than {max_depth} levels")
    try:
        req = _front_door.decode(raw)
        pol = headers.get(subjects.H_POLICY)
        if pol is not None:
            req.policy = _policy.decode(pol)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequestError(f"invalid request: {clip(str(exc), 300)[1:-1]}") from None
    if len(req.model) > MAX_MODEL_NAME:
        raise BadRequestError(f"model name longer than {MAX_MODEL_NAME} characters: {clip(req.model, 60)}")
    if req.messages is not None and bytes(req.messages) == b"null":
        req.messages = None  # type: ignore[assignment]
    if req.prompt is not None and bytes(req.prompt) == b"null":
        req.prompt = None  # type: ignore[assignment]
    given = (req.messages is not None) + (req.prompt is not None) + (req.input is not None)
    if given != 1:
        raise BadRequestError("give exactly one of `messages` (chat), `prompt` (completions) or `input` (embeddings)")
    req.accelerator_id = headers.get(subjects.H_ACCELERATOR_ID) or None
    return req


def continue_asked(req: InferRequest, headers: dict[str, str] | None) -> bool | None:
    """The request's ``continue_on_failure``: its header (a front door moved it there, or any
    sender set it), else its body field; None when neither says."""
    value = (headers or {}).get(subjects.H_CONTINUE)
    if value is not None:
        return value.strip() not in ("0", "false")
    return req.continue_on_failure
