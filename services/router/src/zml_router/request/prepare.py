"""Prepare: the request's policy and what the policies see of it (step 2 of zml_router.request)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import (
    BadRequestError,
)
from zmlcore.messages import InferRequest
from zmlcore.messages.audio import AudioRequest
from zmlcore.policy import ResolvedPolicy, RouteRequest, resolve_policy
from zmlcore.policy.estimate import prompt_tokens_from_body
from zmlcore.policy.prefix import KeyChain, chain_from_header, keyed, request_keys

from zml_router.replicas.promptscale import PROMPT_SCALE

_decode_any = msgspec.json.Decoder()


def check_kind(cfg: ZMLConfig, model: str, req: InferRequest) -> None:
    """Raise BadRequestError when a configured model cannot answer this kind of request.

    Chat, completions and embeddings share ``zml.infer``; the request's fields say its kind
    (``messages``, ``prompt`` or ``input``) and ``[models."X"] embedding`` says what a configured
    model is, so a chat request for an embedding model (or the reverse) is a clear 400 here
    instead of whatever the engine makes of it."""
    mc = cfg.models.get(model)
    if mc is None:
        return  # not configured: the node decides
    if isinstance(req, AudioRequest) != mc.audio:
        if mc.audio:
            raise BadRequestError(f"model {model!r} is a speech-to-text model: use POST /v1/audio/transcriptions "
                                  "or /v1/audio/translations")
        raise BadRequestError(f"model {model!r} is not a speech-to-text model (zml.toml: [models] audio = false)")
    if mc.audio:
        return
    embedding = req.input is not None
    if embedding and not mc.embedding:
        raise BadRequestError(f"model {model!r} is not an embedding model (zml.toml: [models] embedding = false)")
    if mc.embedding and not embedding:
        raise BadRequestError(f"model {model!r} is an embedding model: use POST /v1/embeddings (`input`)")


def prefix_chain(model: str, req: InferRequest, raw: bytes, headers: Mapping[str, str] | None = None) -> KeyChain | None:
    """The prompt's key chain (``zmlcore.policy.prefix``), or None for a prompt too short to hold
    one key block. A front door sends the chain it computed from the prompt it decoded anyway
    (``Zml-Prefix-Keys``, honoured from a front door only: drop_untrusted); else the prompt is
    decoded here (a front door leaves it raw) and keyed."""
    if not keyed(len(raw), req.input is not None):
        return None
    given = headers.get(subjects.H_PREFIX_KEYS) if headers else None
    if given is not None:
        chain = chain_from_header(given, model)
        if chain is not None:
            return chain
    msgs: Any = req.messages
    prompt: Any = req.prompt
    try:
        if isinstance(msgs, msgspec.Raw):
            msgs = _decode_any.decode(msgs) if msgs else None
        if isinstance(prompt, msgspec.Raw):
            prompt = _decode_any.decode(prompt) if prompt else None
    except msgspec.DecodeError:
        return None
    return request_keys(model, msgs, prompt)


def session_owner(owner: str, headers: Mapping[str, str] | None) -> str:
    """Whose session names these are: the identity owning the reply inbox and, behind a front
    door, its caller (``Zml-Owner``: the API key or client address), so that two callers'
    "conv-1" are two sessions."""
    return f"{owner}\x00{(headers or {}).get(subjects.H_OWNER, '')}"


def session_of(headers: Mapping[str, str] | None, req: InferRequest) -> str:
    """The request's session: ``Zml-Session`` (``x-session-id``, the SDK's ``session=``), else
    the OpenAI ``user`` field; "" for none."""
    if headers:
        s = headers.get(subjects.H_SESSION)
        if s:
            return s[:subjects.MAX_SESSION_ID]
    return (req.user or "")[:subjects.MAX_SESSION_ID]


def prepare(cfg: ZMLConfig, families: list[str], req: InferRequest, raw: bytes,
            model: str, session_node: str | None = None,
            headers: Mapping[str, str] | None = None) -> tuple[ResolvedPolicy, RouteRequest]:
    """The policy of a request for ``model`` (its name resolved from an alias: ``cfg.resolve_model``)
    and what the policies see of it (errors: bad policy/kind): its size, its prompt's key chain
    (``headers``: the request's, for a front door's chain) and the node its session is bound to."""
    per_call = req.policy if req.policy is not None else req.routing
    # Chains may name families registered at run time, not only zml.toml's.
    policy = resolve_policy(cfg, model, per_call, families)
    check_kind(cfg, model, req)
    # An embedding is a prefill and no decode: one "output token" for the estimate.
    max_tokens = 1 if req.input is not None else req.max_tokens or req.max_completion_tokens or 512
    # ~4 bytes per token of JSON body: good enough for a TTFT estimate, and O(1). Audio: the
    # encoder's frames for its duration (its bytes say nothing of it).
    # Scaled by what the engines counted of this model's prompts before (PromptScale).
    prompt = req.audio_tokens() if isinstance(req, AudioRequest) else \
        PROMPT_SCALE.scaled(model, prompt_tokens_from_body(len(raw)))
    adapter = cfg.adapters.get(model)
    rr = RouteRequest(model=model, prompt_tokens=prompt, max_tokens=max_tokens,
                      accelerator_id=req.accelerator_id, prefix=prefix_chain(model, req, raw, headers),
                      session_node=session_node, base=adapter.base if adapter is not None else None)
    return policy, rr
