"""One attempt on one node, the pure part (no I/O, no clock): what the node gets, how long it
may take, how it can fail, and what the requester gets back. ``zml_router.node.relay`` does the I/O.

- **The body the node gets** (:class:`NodeBodies`): the caller's bytes untouched when nothing
  must change, else rewritten once per model name the nodes know the model by.
- **The first-byte deadline** (:func:`expected_s`, :func:`first_byte_timeout`) and how long a
  non-streamed request counts as pending (:func:`pending_window_s`).
- **How it failed** (:class:`Failure`, :class:`AttemptError`, :func:`classify`): the node's HTTP
  client (``zml_router.node.dispatch``) raises nothing else, and the request flow
  (``zml_router.request``) decides from the failure class alone whether to fail over, cool the node
  down or give up. An AttemptError is not a ZMLError: a requester never sees one, only the error
  the flow maps it to.
- **The reply the requester gets** (:class:`Renamer`, :func:`with_routing`,
  :func:`routing_headers`, :func:`reply_usage`, :func:`stream_usage`): the model name the client asked for, and the
  routing metadata, spliced into the node's bytes without re-encoding them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from zmlcore import subjects
from zmlcore.messages import NodeState, RoutingInfo, SpeedSample
from zmlcore.messages.audio import AudioForm, with_model
from zmlcore.messages.frontdoor import drop_zml_keys, has_zml_keys
from zmlcore.policy.estimate import (
    estimate_ttft,
    node_coeffs,
    node_slots,
    node_speeds,
    nonstream_pending_s,
    prompt_tokens_from_body,
)
from zmlcore.reply import routingmeta
from zmlcore.reply.sse import event_payloads
from zml_router.node.lora import Lora, as_json

_encode = msgspec.json.encode
_decode_any = msgspec.json.Decoder()


# --- how an attempt fails --------------------------------------------------------------------
class Failure(enum.Enum):
    NETWORK = "network"  # connect/read error, dropped connection: cooldown, retry elsewhere
    SERVER = "server"  # 5xx: cooldown, retry elsewhere
    OVERLOADED = "overloaded"  # vLLM 503 queue overflow, TGI 429: saturated, retry elsewhere
    SLOW = "slow"  # no first byte within the attempt's deadline: cooldown, retry elsewhere
    NO_MODEL = "no_model"  # 404 for the model: the node does not have it, retry elsewhere
    CLIENT = "client"  # other 4xx: the request is at fault; no retry, no cooldown


@dataclass(slots=True)
class AttemptError(Exception):
    failure: Failure
    status: int
    detail: str
    retry_after: float | None = None
    #: True when the caller had already received part of the answer (a stream broken after its
    #: first token): the request cannot start again elsewhere, only be continued
    #: (zml_router.answer.continuation); the node is at fault all the same.
    mid_stream: bool = False
    #: What the node had produced of the answer when it failed (a ``continuation.Sent``), when
    #: it got that far: what a continuation goes on from.
    sent: Any = None
    #: The token counts the node reported before it failed (a stream's usage chunk), if any.
    usage: dict[str, Any] | None = None
    #: The node refused (400/422) a non-streamed request asked of it as a stream to put back
    #: together (a server that takes no ``stream_options``): it may take it asked as it came.
    stream_refused: bool = False


def _retry_after(headers: dict[str, str]) -> float | None:
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def classify(status: int, headers: dict[str, str], body: bytes) -> AttemptError:
    """The failure of a node's non-2xx answer (``headers`` lower-cased)."""
    detail = body[:500].decode("utf-8", "replace")
    ra = _retry_after(headers)
    if status == 429 or status == 503:
        return AttemptError(Failure.OVERLOADED, status, detail, ra)
    if status >= 500:
        return AttemptError(Failure.SERVER, status, detail, ra)
    if status == 404:
        return AttemptError(Failure.NO_MODEL, status, detail, ra)
    return AttemptError(Failure.CLIENT, status, detail, ra)


# --- the body the node gets ------------------------------------------------------------------
class NodeBodies:
    """``bodies(name)``: the body naming model ``name``, for a request asking for ``asked``;
    ``clean``: ZML's fields are already out of ``raw`` (a front-door body).

    A request is forwarded as it came unless (a) it still carries ZML's own fields (a raw
    ``zml.infer`` body; the gateway moves them to headers: zmlcore.messages.frontdoor) or (b) the
    node must see another model name (an alias, or a node's ``served_names`` engine name). Then
    the body is decoded once, and each distinct name is encoded once (a failover to a node with
    another engine name re-encodes, never re-decodes)."""

    __slots__ = ("raw", "asked", "clean", "_data", "_made")

    def __init__(self, raw: bytes, asked: str, clean: bool) -> None:
        self.raw = raw
        self.asked = asked
        self.clean = clean
        self._data: dict[str, Any] | None = None
        self._made: dict[str | tuple[str, Lora], bytes] = {}

    def __call__(self, name: str, lora: Lora | None = None) -> bytes:
        """``lora``: the llama.cpp adapters to run, ``(id, scale)`` pairs (zml_router.node.lora)."""
        key = name if lora is None else (name, lora)
        body = self._made.get(key)
        if body is None:
            if name == self.asked and lora is None and (self.clean or not has_zml_keys(self.raw)):
                body = self.raw  # nothing of ours to strip, the name the node knows: as it came
            else:
                data = self._data
                if data is None:
                    data = _decode_any.decode(self.raw)
                    self._data = data if self.clean else drop_zml_keys(data)
                data["model"] = name
                if lora is None:
                    body = _encode(data)
                else:  # this node's ids, on this body only (another node has its own)
                    body = _encode({**data, "lora": as_json(lora)})
            self._made[key] = body
        return body


class AudioBodies:
    """:class:`NodeBodies` of an audio request: the caller's multipart bytes, with the ``model``
    field's value spliced for a node that knows the model by another name (nothing else of the
    form is touched)."""

    __slots__ = ("raw", "form", "_made")

    def __init__(self, raw: bytes, form: AudioForm) -> None:
        self.raw = raw
        self.form = form
        self._made: dict[str, bytes] = {}

    def __call__(self, name: str) -> bytes:
        if name == self.form.model:
            return self.raw
        body = self._made.get(name)
        if body is None:
            body = self._made[name] = with_model(self.raw, self.form, name)
        return body


# --- how long it may take ----------------------------------------------------------------------
# A node that accepts a connection and never answers would otherwise hold a request for its
# whole timeout. Each attempt therefore gets a deadline for its first byte: the first token of a
# stream, or the whole reply of a non-streamed request (an OpenAI server sends nothing before it
# is done). The deadline is a multiple of what the node should need, from the same model the
# policies use, with a floor so that a fast estimate never turns a small hiccup into a failover:
#
#     streamed:      max(floor, factor x estimated TTFT)
#     not streamed:  max(floor, factor x (estimated TTFT + max_tokens x seconds per token))
#
# Past it the router abandons the attempt (closing the connection frees the node's slot), marks
# the node slow, cools it down for every replica and fails over; a request that never sent a
# byte to its caller loses nothing.

def token_gap_s(st: NodeState, outstanding: int, model: str = "") -> float:
    """Seconds per output token of one more sequence on the node: its learned per-sequence
    decode speed slowed by the batch it joins (the learned slowdown, else the type's)."""
    _, dec, maxc = node_speeds(st, model, explore=False)
    batch = min(outstanding + 1, maxc)
    k = node_slots(st, model)[0]
    return (1.0 + k * (batch - 1)) / dec


#: Prompt tokens an engine prefills in one step between two decode steps (llama.cpp's default
#: n_batch, vLLM's default max_num_batched_tokens with chunked prefill): a streamed answer may
#: wait that long between tokens while another request's prompt is prefilled.
PREFILL_CHUNK_TOKENS = 2048


def stall_timeout(st: NodeState, outstanding: int, floor_s: float, factor: float, cap_s: float,
                  model: str = "") -> float:
    """The attempt's inter-token deadline: ``max(floor, factor x the longest expected gap)``,
    at most ``cap_s``; the expected gap is one decode step plus a prefill chunk of another
    request at the node's learned speeds (``factor`` 0: ``cap_s``, a fixed deadline).

    >>> st = NodeState(node_id="n", accelerator_type="cpu", family="CPU", endpoint="",
    ...                prefill_tps=14_000, decode_tps=500)
    >>> stall_timeout(st, 0, floor_s=1.0, factor=3.0, cap_s=10.0)  # a fast llama-server
    1.0
    >>> st = NodeState(node_id="n", accelerator_type="cpu", family="CPU", endpoint="",
    ...                prefill_tps=1_000, decode_tps=20)
    >>> round(stall_timeout(st, 0, floor_s=1.0, factor=3.0, cap_s=10.0), 2)
    6.29
    """
    if factor <= 0:
        return cap_s
    pf, _, _ = node_speeds(st, model, explore=False)
    gap = token_gap_s(st, outstanding, model) + PREFILL_CHUNK_TOKENS / pf
    return min(cap_s, max(floor_s, factor * gap))


@dataclass(slots=True)
class AtDispatch:
    """What the router knew of the node when it sent an attempt, for the sample of its speeds
    and the prediction the reply carries (zmlcore.fleet.learn; docs/routing.md "Learned speeds")."""

    #: time.monotonic() when the attempt was sent
    at: float
    #: sequences on the node with this one (every replica's), and the prompt tokens pending
    #: on it ahead of this one (None: not known well enough to learn a prefill speed from)
    inflight: int
    ahead: float | None
    #: this request's uncached prompt tokens as estimated at dispatch
    uncached: float
    predicted_ttft_s: float
    #: the router's running total of prompt tokens sent to the node, this request's included
    #: (``Relay.fed``): what it reads again at the first token and at the last tells which
    #: prompts shared the node with this one's prefill and its decode
    fed: float = 0.0


class Learned:
    """A node's learned speeds for one model as an attempt uses them (no exploration's optimism):
    built once per node state (the router keeps one per node and model until its state changes),
    so that predictions and deadlines cost a few arithmetic operations per attempt."""

    __slots__ = ("state", "coeffs", "step1", "k", "maxc", "chunk_s")

    def __init__(self, st: NodeState, model: str = "") -> None:
        self.state = st
        c = self.coeffs = node_coeffs(st, model, explore=False)
        self.k = c.slowdown
        self.step1 = 1.0 / node_speeds(st, model, explore=False)[1]
        self.maxc = c.maxc
        self.chunk_s = PREFILL_CHUNK_TOKENS / c.pf

    def gap_s(self, outstanding: int) -> float:
        """Seconds per output token of one more sequence (token_gap_s)."""
        return (1.0 + self.k * (min(outstanding + 1, self.maxc) - 1)) * self.step1

    def expected_s(self, outstanding: int, pending: int, prompt_tokens: int, max_tokens: int, stream: bool) -> float:
        """Seconds the node should need before its first byte reaches the router: the learned
        TTFT estimate as it is (exploration's optimism would only tighten the deadline), and for
        a non-streamed reply its decode too (it comes at the end). From these coefficients, not
        the node's state: no estimate rebuilt per attempt.

        >>> st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
        >>> round(Learned(st).expected_s(0, 0, 1000, 100, stream=True), 3)
        0.1
        >>> round(Learned(st).expected_s(0, 0, 1000, 60, stream=False), 3)
        1.1
        >>> e = Learned(st, "m").expected_s(3, 1, 1000, 60, True)
        >>> e == estimate_ttft(st, 3, 1, 1000, model="m", explore=False)
        True
        """
        ttft = self.coeffs.load_key(outstanding, pending) + prompt_tokens * self.coeffs.inv_pf
        return ttft if stream else ttft + max_tokens * self.gap_s(outstanding)

    def stall_s(self, outstanding: int, floor_s: float, factor: float, cap_s: float) -> float:
        """The inter-token deadline (stall_timeout)."""
        if factor <= 0:
            return cap_s
        return min(cap_s, max(floor_s, factor * (self.gap_s(outstanding) + self.chunk_s)))


def at_dispatch(sp: Learned, outstanding: int, pending: int, pending_tokens: float | None, prompt_tokens: int,
                cached_tokens: int, now: float) -> AtDispatch:
    """The attempt's dispatch figures (``outstanding``/``pending``: the node's counters before it).

    >>> st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    >>> d = at_dispatch(Learned(st, "m"), 0, 0, None, 1000, 200, now=5.0)
    >>> d.inflight, d.ahead, d.uncached, round(d.predicted_ttft_s, 3)
    (1, 0.0, 800, 0.08)
    >>> round(d.predicted_ttft_s, 6) == round(estimate_ttft(st, 0, 0, 800, explore=False), 6)
    True
    """
    uncached = max(prompt_tokens - cached_tokens, 1)
    ahead = pending_tokens if pending_tokens is not None else (0.0 if pending == 0 else None)
    c = sp.coeffs
    ttft = c.load_key(outstanding, pending, pending_tokens) + uncached * c.inv_pf
    return AtDispatch(at=now, inflight=outstanding + 1, ahead=ahead, uncached=uncached, predicted_ttft_s=ttft)


def speed_sample(d: AtDispatch, first_at: float, end_at: float, tokens: int, prompt_tokens: int | None,
                 cached: int | None, engine: tuple[float, float] = (0.0, 0.0), fed_first: float = 0.0,
                 fed_end: float = 0.0, loaded_adapter: bool = False) -> SpeedSample:
    """What an attempt showed of its node's speeds: its TTFT over the prompt tokens the node
    computed before its first token (the engine's count of this request's uncached tokens when
    it reported one), its tokens after the first over the time they took, and what else the
    node was given meanwhile: the router's running total of prompt tokens sent to the node at
    the first token (``fed_first``) and at the last (``fed_end``) against ``d.fed``. With
    ``loaded_adapter`` (the node was chosen to load the request's adapter first: vLLM's LoRA
    resolver) what its first byte took beyond the estimate is that load's time.

    >>> d = AtDispatch(at=10.0, inflight=2, ahead=0.0, uncached=800, predicted_ttft_s=0.08, fed=5000.0)
    >>> speed_sample(d, first_at=10.125, end_at=11.125, tokens=51, prompt_tokens=1000, cached=100,
    ...              fed_first=5000.0, fed_end=5600.0)
    SpeedSample(ttft_s=0.125, prefill_tokens=900.0, prefill_reported=True, inflight=2, decode_s=1.0, decode_tokens=50, engine_prefill_tps=0.0, engine_decode_tps=0.0, predicted_ttft_s=0.08, alone=True, joined_tokens=0.0, decode_prefill_tokens=600.0, adapter_load_s=None)
    >>> round(speed_sample(d, 10.98, 11.5, 20, 1000, 100, loaded_adapter=True).adapter_load_s, 3)
    0.9
    """
    reported = prompt_tokens is not None and prompt_tokens > 0 and cached is not None
    own = max(prompt_tokens - cached, 1) if reported else d.uncached  # type: ignore[operator]
    joined = fed_first - d.fed if fed_first > d.fed else 0.0
    # no round(): ~0.3 us each on the router's path, and the event's JSON carries any float
    return SpeedSample(
        ttft_s=first_at - d.at,
        prefill_tokens=float(own + d.ahead) if d.ahead is not None else 0.0,
        prefill_reported=reported, inflight=d.inflight,
        decode_s=end_at - first_at if tokens > 1 else 0.0, decode_tokens=tokens - 1 if tokens > 1 else 0,
        engine_prefill_tps=engine[0], engine_decode_tps=engine[1],
        predicted_ttft_s=d.predicted_ttft_s,
        alone=d.ahead == 0.0 and joined == 0.0, joined_tokens=joined,
        decode_prefill_tokens=fed_end - fed_first if fed_end > fed_first else 0.0,
        adapter_load_s=max(0.0, first_at - d.at - d.predicted_ttft_s) if loaded_adapter else None,
    )


def first_byte_timeout(expected: float, floor_s: float, factor: float) -> float:
    """The attempt's deadline for its first byte, in seconds.

    >>> first_byte_timeout(0.1, floor_s=5.0, factor=4.0)
    5.0
    >>> first_byte_timeout(3.0, floor_s=5.0, factor=4.0)
    12.0
    """
    return max(floor_s, factor * expected)


def pending_window_s(st: NodeState, outstanding: int, pending: int, body_bytes: int,
                     prompt_tokens: int | None = None) -> float:
    """How long a non-streamed request of ``body_bytes`` (or, given, ``prompt_tokens``: an audio
    request's bytes say nothing of its cost) about to go to a node with these counters counts as
    ``pending`` (not yet at its first token).

    A plain reply shows the router no first token, so counting it pending until completion made
    a node look prefill-bound through every such request's decode (benches/routing_sim.py: 1.14x
    the oracle's p99 at 80% load instead of 1.00x). Instead its pending count ends when the TTFT
    the policy estimated for it has passed (``zmlcore.policy.estimate.nonstream_pending_s``), or
    at completion if that comes first (``zml_router.node.pending.PendingHold``). The simulator models
    exactly this (``--pending-expiry``)."""
    tokens = prompt_tokens if prompt_tokens is not None else prompt_tokens_from_body(body_bytes)
    return nonstream_pending_s(st, outstanding, pending, tokens)


# --- the reply the requester gets ----------------------------------------------------------------
_USAGE = re.compile(rb'"(prompt_tokens|completion_tokens|total_tokens)"\s*:\s*(\d+)')


def reply_usage(raw: bytes) -> dict[str, Any]:
    """The first prompt/completion/total token counts in a reply body, in one scan of it (for
    the metrics, the trace and the routing metadata alike), without decoding the body."""
    found: dict[str, Any] = {}
    for m in _USAGE.finditer(raw):
        found.setdefault(m.group(1).decode(), int(m.group(2)))
    return found


def stream_usage(chunk: bytes) -> dict | None:  # type: ignore[type-arg]
    """The ``usage`` object of a stream chunk (one payload, or a relayed block of events: its
    last, the running total where the engine sends usage with every chunk, as vLLM's
    ``continuous_usage_stats`` does)."""
    if b'"usage"' not in chunk:
        return None
    for payload in reversed(event_payloads(chunk)) if chunk.startswith(b"data:") else (chunk,):
        if b'"usage"' not in payload:
            continue
        try:
            usage = _decode_any.decode(payload).get("usage")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            return usage
    return None


def with_routing(raw: bytes, info: RoutingInfo) -> bytes:
    """The node's JSON object with ``"zml": {...}`` appended, without re-encoding the body."""
    body = raw.rstrip()
    if body[:1] == b"{" and body[-1:] == b"}":
        sep = b"," if body[1:-1].strip() else b""
        return body[:-1] + sep + b'"zml":' + _encode(info) + b"}"
    raise AttemptError(Failure.SERVER, 200, f"node answered a non-object JSON body: {raw[:100]!r}")


def routing_headers(request_headers: dict[str, str] | None, info: RoutingInfo) -> dict[str, str]:
    """The Zml-* routing headers of a reply, or none for a requester that reads the routing
    metadata from the body (``Zml-Accept-Routing: body``): it travels once."""
    if (request_headers or {}).get(subjects.H_ACCEPT_ROUTING) == subjects.ROUTING_IN_BODY:
        return {}
    return routingmeta.nats_headers(info)


_KEY = b'"model"'
_WS = b" \t\r\n"


class Renamer:
    """Replace ``engine_name`` by ``asked`` as a reply's (or stream chunk's) ``model``.

    A node with ``served_names`` is sent the engine's own name for a model (a GGUF path, the path
    vLLM was started with) and answers with it; the client gets back the name it asked for. The
    router forwards the node's bytes as they are, so the rename is a targeted byte edit of the
    ``"model"`` value: find ``"model"``, skip the colon and whitespace, compare the value with the
    JSON string of the engine's name, splice. No regex and no decode of the body; a body where
    that fails (an engine escaping ``/`` as ``\\/``, say) is decoded once and re-encoded with the
    top-level ``model`` replaced.

    >>> r = Renamer("/models/llama.gguf", "llama-3-8b")
    >>> r(b'{"id":"x","model": "/models/llama.gguf","choices":[]}')
    b'{"id":"x","model": "llama-3-8b","choices":[]}'
    """

    __slots__ = ("engine", "asked", "engine_json", "asked_json")

    def __init__(self, engine_name: str, asked: str) -> None:
        self.engine = engine_name
        self.asked = asked
        self.engine_json = _encode(engine_name)
        self.asked_json = _encode(asked)

    def __call__(self, body: bytes) -> bytes:
        if _KEY not in body:
            return body  # a chunk without "model" (some engines' last chunks)
        start = 0
        while (k := body.find(_KEY, start)) >= 0:
            start = k + len(_KEY)
            i = start
            n = len(body)
            while i < n and body[i] in _WS:
                i += 1
            if i >= n or body[i] != 0x3A:  # ':' -- the word in a value, not a key
                continue
            i += 1
            while i < n and body[i] in _WS:
                i += 1
            if body.startswith(self.engine_json, i):
                return body[:i] + self.asked_json + body[i + len(self.engine_json):]
        return self._slow(body)

    def _slow(self, body: bytes) -> bytes:
        try:
            data = _decode_any.decode(body)
        except msgspec.DecodeError:
            return body
        if isinstance(data, dict) and data.get("model") == self.engine:
            data["model"] = self.asked
            return _encode(data)
        return body
