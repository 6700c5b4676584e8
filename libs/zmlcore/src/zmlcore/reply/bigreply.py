"""Replies larger than NATS's ``max_payload``: sent in parts on the requester's reply subject.

A non-streamed reply (a long completion, many embeddings) may not fit in one NATS message
(1 MiB by default). It is never lost after the node did the work:

- A requester that collects parts says so on its request: ``Zml-Accept-Parts: <most bytes it
  collects>`` (the gateway and the SDK always do; raw NATS clients may). The router then sends
  such a reply as ``n`` messages on the same reply subject, ``Zml-Part: k`` / ``Zml-Parts: n``,
  in order; part 1 carries the usual reply headers. A reply over the requester's limit is a
  REPLY_TOO_LARGE error reply instead.
- A requester that does not declare it is refused *before the node runs* (REPLY_TOO_LARGE)
  when :func:`reply_bound` says the reply could exceed one message. If a reply still turns out
  bigger than the bound, it gets the same error code after the work rather than a truncated or
  missing reply (a client reading one message could not tell a part from a whole reply).

Why parts on the reply subject and not a JetStream object store (what ZML did before): the
reply subject is already private to the requester (per-identity inboxes, docs/security.md), so
every identity that can make a request can receive its reply, with no bucket, no extra
permission and nothing left behind when the requester goes away.

Core NATS is at-most-once: a lost part is noticed (a number skipped, or no next part within
:data:`PART_WAIT_S`) and the request fails with REPLY_INCOMPLETE (retryable), never with a
truncated body. Pure functions and a sans-I/O :class:`Collector`; the I/O is in
:mod:`zmlcore.reply.parts`.

    >>> parts = split(b"x" * 10, {"Zml-Node-Id": "n1"}, part_bytes=4)
    >>> [(len(d), h["Zml-Part"], h["Zml-Parts"]) for d, h in parts]
    [(4, '1', '3'), (4, '2', '3'), (2, '3', '3')]
    >>> c = Collector(max_bytes=100)
    >>> [c.feed(d, h) for d, h in parts][-1]
    b'xxxxxxxxxx'
"""

from __future__ import annotations

from collections.abc import Mapping
import msgspec

from zmlcore import subjects
from zmlcore.errors import ReplyIncompleteError, ReplyTooLargeError
from zmlcore.messages import InferRequest

#: Room for headers in each message (part 1 carries the routing headers).
HEADER_ROOM = 4096
#: Parts are published back to back: a part this late after the previous one was lost.
PART_WAIT_S = 10.0
#: Context window assumed for the bound when neither the request (max_tokens) nor the model's
#: config ([models.X] max_model_len) gives one.
ASSUMED_MAX_MODEL_LEN = 32768
#: Embedding width assumed when the request gives no ``dimensions``.
ASSUMED_EMBEDDING_DIMS = 1024


def part_bytes(max_payload: int | None) -> int:
    """Most body bytes one message of a reply carries."""
    return max(1024, (max_payload or 1024 * 1024) - HEADER_ROOM)


def accepted(headers: Mapping[str, str] | None) -> int | None:
    """The requester's ``Zml-Accept-Parts`` limit in bytes, or None (it collects no parts)."""
    value = (headers or {}).get(subjects.H_ACCEPT_PARTS, "")
    limit = int(value) if value.isascii() and value.isdigit() and len(value) <= 15 else 0
    return limit or None


def split(data: bytes, headers: dict[str, str], part_bytes: int) -> list[tuple[bytes, dict[str, str]]]:
    """The messages of one reply: a single one when it fits, else numbered parts."""
    if len(data) <= part_bytes:
        return [(data, headers)]
    n = -(-len(data) // part_bytes)
    out = []
    for k in range(n):
        h = {subjects.H_PART: str(k + 1), subjects.H_PARTS: str(n)}
        if k == 0:
            h = {**headers, **h}
        elif subjects.H_REQUEST_ID in headers:
            h[subjects.H_REQUEST_ID] = headers[subjects.H_REQUEST_ID]
        out.append((data[k * part_bytes:(k + 1) * part_bytes], h))
    return out


def plan(data: bytes, headers: dict[str, str], max_payload: int | None,
         accept: int | None) -> list[tuple[bytes, dict[str, str]]]:
    """What the router publishes for a finished reply; ReplyTooLargeError when the requester
    cannot receive it (no ``Zml-Accept-Parts``, or over its limit)."""
    size = part_bytes(max_payload)
    if len(data) <= size:
        return [(data, headers)]
    if accept is None:
        raise ReplyTooLargeError(
            f"the reply is {len(data)} bytes, over the {size} bytes one NATS message carries, and this request "
            f"did not declare that it collects replies in parts: send the header {subjects.H_ACCEPT_PARTS}: "
            "<max bytes> (see docs/security.md), or ask for less")
    if len(data) > accept:
        raise ReplyTooLargeError(f"the reply is {len(data)} bytes, over this request's {subjects.H_ACCEPT_PARTS} "
                                 f"limit of {accept} bytes")
    return split(data, headers, size)


class Collector:
    """Puts one reply back together from its messages (sans-I/O: the caller feeds what arrives).

    :meth:`feed` returns the whole body once complete, None while parts are missing, and raises
    ReplyIncompleteError on a gap or ReplyTooLargeError over ``max_bytes``. :attr:`headers` are
    the first message's (the reply headers)."""

    __slots__ = ("max_bytes", "headers", "n", "next", "size", "_parts")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.headers: dict[str, str] = {}
        self.n = 0
        self.next = 1
        self.size = 0
        self._parts: list[bytes] = []

    @property
    def started(self) -> bool:
        return self.n > 0

    def feed(self, data: bytes, headers: Mapping[str, str] | None) -> bytes | None:
        h = dict(headers or {})
        part, parts = h.get(subjects.H_PART), h.get(subjects.H_PARTS)
        if part is None and not self.started:
            self.headers = h
            return data  # a reply in one message
        k = int(part) if part and part.isdigit() else 0
        n = int(parts) if parts and parts.isdigit() else 0
        if not self.started:
            if n < 2 or n > self.max_bytes:
                raise ReplyIncompleteError(f"malformed reply part ({subjects.H_PART}={part!r}, "
                                           f"{subjects.H_PARTS}={parts!r})", retry_after=1.0)
            self.n, self.headers = n, h
        if n != self.n or k != self.next:
            raise ReplyIncompleteError(f"part {self.next} of {self.n} of the reply was lost on the way; retry",
                                       retry_after=1.0)
        self.size += len(data)
        if self.size > self.max_bytes:
            raise ReplyTooLargeError(f"the reply is over this requester's limit of {self.max_bytes} bytes")
        self._parts.append(data)
        self.next += 1
        if k < n:
            return None
        body, self._parts = b"".join(self._parts), []
        return body

    def lost(self) -> ReplyIncompleteError:
        """The error when no next part came within PART_WAIT_S."""
        return ReplyIncompleteError(f"part {self.next} of {self.n} of the reply did not arrive; retry",
                                    retry_after=1.0)


# --- the bound: how large a reply could be, from the request alone ---------------------------

class _Shape(msgspec.Struct, kw_only=True):
    """OpenAI parameters that multiply a reply's size (kept raw in InferRequest)."""

    n: int = 1
    best_of: int | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool = False
    dimensions: int | None = None
    encoding_format: str | None = None


_shape = msgspec.json.Decoder(_Shape)

#: JSON bytes per generated token: ~4 characters of text, with room for escapes.
_TOKEN_BYTES = 8
#: ... and per token with logprobs: the token's entry, plus one per alternative.
_LOGPROB_BYTES, _TOP_LOGPROB_BYTES = 100, 90
#: An embedding value as JSON (``-0.01234567890123456,``) or base64 (4 bytes -> 5.33 chars).
_FLOAT_JSON, _FLOAT_B64 = 24, 6
_OVERHEAD, _PER_CHOICE, _PER_VECTOR = 2048, 256, 128


def reply_bound(raw: bytes, req: InferRequest, max_model_len: int | None) -> int:
    """Bytes the non-streamed reply to ``req`` could take (generous, O(1) in the generation):
    tokens (``max_tokens``, else the model's context window) x bytes per token (with logprobs)
    x choices, or inputs x dimensions for embeddings."""
    try:
        shape = _shape.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        shape = _Shape()  # wrong types: the node refuses the request, its error is small
    if req.input is not None:
        items = 1 if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)) else len(req.input)
        dims = shape.dimensions if shape.dimensions and shape.dimensions > 0 else ASSUMED_EMBEDDING_DIMS
        per = _FLOAT_B64 if shape.encoding_format == "base64" else _FLOAT_JSON
        return _OVERHEAD + items * (_PER_VECTOR + dims * per)
    tokens = req.max_tokens or req.max_completion_tokens or max_model_len or ASSUMED_MAX_MODEL_LEN
    per_token = _TOKEN_BYTES
    if shape.logprobs:  # chat: true + top_logprobs; completions: the number of alternatives
        top = shape.top_logprobs if shape.top_logprobs is not None else (
            shape.logprobs if isinstance(shape.logprobs, int) and shape.logprobs is not True else 0)
        per_token += _LOGPROB_BYTES + max(0, top) * _TOP_LOGPROB_BYTES
    choices = max(1, shape.n, shape.best_of or 1)
    echoed = len(raw) if shape.echo else 0
    return _OVERHEAD + choices * (_PER_CHOICE + echoed + tokens * per_token)


def check_fits(raw: bytes, req: InferRequest, headers: Mapping[str, str] | None, max_payload: int | None,
               max_model_len: int | None) -> None:
    """Refuse (REPLY_TOO_LARGE), before any node works on it, a non-streamed request whose
    reply could exceed one message when its requester does not collect parts."""
    if req.stream or accepted(headers) is not None:
        return
    size, bound = part_bytes(max_payload), reply_bound(raw, req, max_model_len)
    if bound > size:
        raise ReplyTooLargeError(
            f"the reply to this request could be about {bound} bytes, over the {size} bytes one NATS message "
            f"carries: send the header {subjects.H_ACCEPT_PARTS}: <max bytes> to receive it in parts "
            "(see docs/security.md), or ask for less (max_tokens, n, fewer inputs)")
