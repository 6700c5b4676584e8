"""Continuing an answer on another node when its node fails part-way (sans-I/O, unit-tested).

A node that dies, resets, drops or stalls after its first token used to end the stream with an
error: the caller had part of the answer and a retry would repeat it. Instead the router asks
another node of the policy's chain for the *rest*: the same request with the text already sent
as the start of the assistant's message, through the engine's own mechanism for it
(:func:`body`), and ``max_tokens`` reduced by what was sent; then it splices that node's stream
into the one the caller is reading (:class:`Splice`): one stream, one ``finish_reason``, usage
that adds up, ``zml.continued_from`` saying what happened.

- **What was sent** (:class:`Transcript`, :class:`Sent`): the chunks as relayed, kept as bytes
  on the happy path (one list append per chunk) and read only when an attempt fails.
- **May it continue?** (:func:`refusal`): not when the request or its policy says
  ``continue_on_failure = false``, nor when a continuation could not be the same answer: ``n >
  1``, logprobs, a ``seed`` (reproducibility), constrained output (``response_format``,
  guided decoding), ``echo``, a pinned node, token-id or several prompts, tool-call or
  reasoning deltas already sent.
- **The continuation's body** (:func:`body`): chat: an assistant message holding the text so
  far, continued as each engine does it: vLLM ``continue_final_message: true`` with
  ``add_generation_prompt: false``, SGLang and TGI ``continue_final_message: true``, llama.cpp
  its assistant prefill (on by default: a final assistant message is continued); completions:
  the prompt plus the text so far. An OpenAI-compatible server of unknown make
  (``backend = "openai"``) has no such mechanism and never continues an answer
  (``zml_router.replicas.table.engine_continues``).
- **Usage**: the continuation's prompt holds the text so far, so its ``prompt_tokens`` less the
  tokens sent is the first attempt's prompt, and the tokens sent plus its ``completion_tokens``
  are the answer's: ``total_tokens`` is the continuation's own. Tokens sent are counted as
  content chunks (one token each on vLLM, SGLang, TGI and llama.cpp, which stream a token per
  event; an engine that puts several tokens in one event makes the count, and the reduction of
  ``max_tokens``, lower by those).
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmlcore.messages.frontdoor import drop_zml_keys
from zmlcore.reply.sse import event_payloads
# What was sent, read from the chunks relayed: the requester (gateway, SDK) reads it the same way
# to continue a stream whose router died (zmlcore.reply.resume).
from zmlcore.reply.transcript import Sent, chunk_decoder as _chunk

_decode_any = msgspec.json.Decoder()
_encode = msgspec.json.encode


def engine_error(chunk: bytes) -> str | None:
    """The message of an engine's error event in a relayed chunk (vLLM and SGLang send
    ``data: {"error": {...}}`` and then end the stream when a request fails mid-way), or None.
    Called only for chunks holding ``"error"``."""
    payloads = event_payloads(chunk) if chunk.startswith(b"data:") else [chunk]
    for payload in payloads:
        if b'"error"' not in payload:
            continue
        try:
            c = _chunk.decode(payload)
        except msgspec.DecodeError:
            continue
        if c.error is not None and not c.choices:
            err = c.error
            msg = err.get("message") if isinstance(err, dict) else err
            return str(msg)[:300]
    return None


# --- may it continue? --------------------------------------------------------------------------
class _Asks(msgspec.Struct):
    """What a request body asks that bears on continuing it."""

    messages: Any = None
    prompt: Any = None
    n: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    seed: Any = None
    echo: Any = None
    best_of: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    grammar: Any = None
    json_schema: Any = None
    continue_final_message: Any = None
    continue_on_failure: Any = None


_asks = msgspec.json.Decoder(_Asks)


def refusal(raw: bytes, *, asked: bool | None, policy_allows: bool, pinned: bool,
            sent: Sent | None = None) -> str | None:
    """Why this request's answer cannot be continued on another node, or None.

    ``raw``: the request body; ``asked``: its ``continue_on_failure`` (None: not given);
    ``policy_allows``: its policy's ``continue_on_failure``; ``pinned``: it names its node;
    ``sent``: what the requester has of the answer so far.

    >>> refusal(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', asked=None,
    ...         policy_allows=True, pinned=False)
    >>> refusal(b'{"model":"m","prompt":"hi","seed":7}', asked=None, policy_allows=True, pinned=False)
    'a seed was given (the answer must be reproducible)'
    """
    if asked is False:
        return "the request says continue_on_failure: false"
    if not policy_allows:
        return "its policy says continue_on_failure = false"
    if pinned:
        return "it is pinned to one node (accelerator_id)"
    try:
        a = _asks.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "its body could not be read again"
    if a.continue_on_failure is False:
        return "the request says continue_on_failure: false"
    if isinstance(a.n, int) and a.n > 1 or isinstance(a.best_of, int) and a.best_of > 1:
        return "it asks for several choices (n > 1)"
    if a.logprobs not in (None, False) or a.top_logprobs not in (None, 0):
        return "it asks for logprobs"
    if a.seed is not None:
        return "a seed was given (the answer must be reproducible)"
    if a.echo:
        return "it asks for echo"
    rf = a.response_format
    if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) or any(
            v is not None for v in (a.guided_json, a.guided_regex, a.guided_choice, a.guided_grammar,
                                    a.structured_outputs, a.grammar, a.json_schema)):
        return "its output is constrained (response_format or guided decoding)"
    if a.messages is not None:
        msgs = a.messages
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict):
            return "its messages could not be read"
        last = msgs[-1]
        if last.get("role") == "assistant":
            if a.continue_final_message is not True:
                return "it ends with an assistant message that is not continued"
            if not isinstance(last.get("content"), str):
                return "its final assistant message is not text"
    elif a.prompt is not None:
        p = a.prompt
        if not (isinstance(p, str) or (isinstance(p, list) and len(p) == 1 and isinstance(p[0], str))):
            return "its prompt is token ids or several prompts"
    else:
        return "it is not a chat or completion"
    if sent is not None:
        if sent.blocked:
            return f"the answer so far has {sent.blocked}"
    return None


def remaining(raw_max: int | None, sent: Sent) -> int | None:
    """Tokens the continuation may generate: ``max_tokens`` less what was sent (None: no limit
    was asked). 0 or less: the answer had all its tokens and lost only its end."""
    return None if raw_max is None else raw_max - sent.tokens


def complete(raw: bytes, sent: Sent) -> bool:
    """Whether the requester has the whole answer and lost at most its end: its finish went out
    (only the usage or the stream's end is missing), or every token ``max_tokens`` allowed did
    (the node would have ended with ``finish_reason: "length"``). Such an answer is ended by
    the router (:func:`closing_chunk`), not continued; the latter for one choice of plain text
    only (tool-call deltas end with another reason)."""
    if sent.finished:
        return True
    if not sent.tokens or sent.blocked:
        return False
    left = remaining(max_asked(raw), sent)
    return left is not None and left <= 0


def closing_chunk(kind: str, sent: Sent, model: str, zml: dict[str, Any]) -> bytes:
    """The chunk that ends an answer which had all its ``max_tokens`` (:func:`complete`): what
    the node would have sent last, and ``zml`` saying what happened, as a continuation's last
    chunk does. No usage: the node's prompt count was lost with it.

    >>> closing_chunk("chat", Sent(tokens=4, chunk_id="c1", created=7), "m", {"attempts": 1})
    b'{"id":"c1","object":"chat.completion.chunk","created":7,"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}],"zml":{"attempts":1}}'
    """
    chat = kind == "chat"
    choice: dict[str, Any] = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
    choice["finish_reason"] = "length"
    return _encode({"id": sent.chunk_id or "", "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": sent.created or 0, "model": model, "choices": [choice], "zml": zml})


# --- the continuation's body ---------------------------------------------------------------------
def body(raw: bytes, *, clean: bool, kind: str, sent: Sent, backend: str, name: str,
         usage: bool = False, lora: tuple[tuple[int, float], ...] | None = None) -> bytes:
    """The body that asks a ``backend`` node (its name for the model: ``name``) for the rest of
    the answer ``sent`` began. ``clean``: ZML's fields are already out of ``raw``; ``usage``:
    ask for the usage chunk whatever the caller asked (the router needs it)."""
    data = _decode_any.decode(raw)
    if not clean:
        drop_zml_keys(data)
    data.pop("continue_on_failure", None)
    data["model"] = name
    if lora is not None:  # llama.cpp adapters of the node it goes to (zml_router.node.lora)
        data["lora"] = [{"id": i, "scale": sc} for i, sc in lora]
    text = sent.text
    if text:
        if kind == "chat":
            msgs = data["messages"]
            last = msgs[-1]
            if last.get("role") == "assistant" and data.get("continue_final_message") is True:
                msgs[-1] = {**last, "content": last["content"] + text}
            else:
                msgs.append({"role": "assistant", "content": text})
            if backend == "vllm":
                data["continue_final_message"] = True
                data["add_generation_prompt"] = False
            elif backend in ("sglang", "tgi"):
                data["continue_final_message"] = True
            # llama.cpp continues a final assistant message by default (assistant prefill).
        else:
            p = data["prompt"]
            data["prompt"] = p + text if isinstance(p, str) else [p[0] + text]
    for key in ("max_tokens", "max_completion_tokens"):
        v = data.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            data[key] = max(1, v - sent.tokens)
    v = data.get("min_tokens")
    if isinstance(v, int) and not isinstance(v, bool):
        data["min_tokens"] = max(0, v - sent.tokens)
    data["stream"] = True
    if usage:
        opts = data.get("stream_options")
        data["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return _encode(data)


def max_asked(raw: bytes) -> int | None:
    """The request's ``max_tokens`` (or ``max_completion_tokens``), None when not given."""
    try:
        d = _max.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    v = d.max_completion_tokens if isinstance(d.max_completion_tokens, int) else d.max_tokens
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Max(msgspec.Struct):
    max_tokens: Any = None
    max_completion_tokens: Any = None


_max = msgspec.json.Decoder(_Max)


# --- the splice ------------------------------------------------------------------------------------
def spliced_usage(usage: dict[str, Any], sent: Sent) -> dict[str, Any]:
    """The continuation's usage as the whole answer's: its prompt held the text sent."""
    out = dict(usage)
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(p, int) and isinstance(c, int):
        out["prompt_tokens"] = max(0, p - sent.tokens)
        out["completion_tokens"] = c + sent.tokens
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        details = out.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            out["prompt_tokens_details"] = {**details,
                                            "cached_tokens": min(details["cached_tokens"], out["prompt_tokens"])}
    return out


class Splice:
    """Rewrites the continuation's chunks into the stream the requester is reading: the chunk
    that only re-announces the assistant's role goes, every chunk gets the first attempt's
    ``id`` and ``created``, the usage chunk counts the whole answer, and the chunk that ends
    the answer carries ``zml`` (``attempts``, ``continued_from``) so that a client reading the
    SSE stream sees what happened."""

    __slots__ = ("sent", "zml")

    def __init__(self, sent: Sent, zml: dict[str, Any]) -> None:
        self.sent = sent
        self.zml = zml

    def payload(self, data: bytes) -> bytes | None:
        """One chunk's JSON, rewritten; None to drop it."""
        try:
            d = _decode_any.decode(data)
        except msgspec.DecodeError:
            return data
        if not isinstance(d, dict) or ("error" in d and not d.get("choices")):
            return data
        choices = d.get("choices")
        keep = d.get("usage") is not None
        ends = False
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict):
                    keep = True
                    continue
                delta = ch.get("delta")
                if isinstance(delta, dict):
                    delta.pop("role", None)
                    if delta.get("content") == "" or ("content" in delta and delta["content"] is None
                                                      and len(delta) > 1):
                        delta.pop("content")
                    if delta:
                        keep = True
                if ch.get("text"):
                    keep = True
                if ch.get("finish_reason") is not None:
                    keep = ends = True
                if ch.get("logprobs") is not None:
                    keep = True
        if not keep:
            return None
        if self.sent.chunk_id is not None and "id" in d:
            d["id"] = self.sent.chunk_id
        if self.sent.created is not None and "created" in d:
            d["created"] = self.sent.created
        usage = d.get("usage")
        if isinstance(usage, dict):
            d["usage"] = spliced_usage(usage, self.sent)
        if ends:
            d["zml"] = self.zml
        return _encode(d)

    def events(self, block: bytes) -> bytes:
        """A block of SSE events, each rewritten (dropped ones left out)."""
        out = []
        for payload in event_payloads(block):
            p = self.payload(payload)
            if p is not None:
                out.append(b"data: " + p + b"\n\n")
        return b"".join(out)
