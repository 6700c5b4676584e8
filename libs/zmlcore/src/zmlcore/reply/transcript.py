"""What a stream's reader has been sent of the answer, read from the chunks relayed to it
(sans-I/O): the text so far, the content chunks that carried it (tokens, on engines that stream
one token per event), the chunks' ``id`` and ``created``, whether the answer finished, and what
would make a continuation a different answer (tool-call deltas...).

Both ends of a relay read it the same way: the router, to continue an answer whose *node*
failed part-way (``zml_router.answer.continuation``), and the requester (the gateway, the SDK), to
have another router continue an answer whose *router* died (:mod:`zmlcore.reply.resume`).
Keeping it costs one list append per chunk; the chunks are decoded only when asked, or folded
now and then (:meth:`Transcript.fold`) so that a long answer holds its text, not its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from zmlcore.reply.sse import event_payloads

class ChunkDelta(msgspec.Struct):
    """A chat chunk's ``delta`` (OpenAI's fields; the router's assembler reads them too)."""

    role: Any = None
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None


class ChunkChoice(msgspec.Struct):
    """One choice of a stream chunk (chat ``delta`` or completion ``text``)."""

    index: Any = 0
    delta: ChunkDelta | None = None
    text: Any = None
    finish_reason: Any = None
    stop_reason: Any = None
    logprobs: Any = None


class _Chunk(msgspec.Struct):
    id: Any = None
    created: Any = None
    choices: Any = None
    usage: Any = None
    error: Any = None


#: One OpenAI chunk, as far as what was sent goes (its ``error``: an engine's error event).
chunk_decoder = _chunk = msgspec.json.Decoder(_Chunk)


class _TypedChunk(msgspec.Struct):
    """:class:`_Chunk` with its choices typed: one decode, no convert, for the usual chunk."""

    id: Any = None
    created: Any = None
    choices: list[ChunkChoice] | None = None
    usage: Any = None


_typed_chunk = msgspec.json.Decoder(_TypedChunk)


def _payloads(block: bytes) -> list[bytes]:
    """The data payloads of a block of SSE events: one ``data: ...`` event without a scan."""
    if block.startswith(b"data: ") and block.find(b"\n") == len(block) - 2 and block.endswith(b"\n\n"):
        return [block[6:-2]]
    return event_payloads(block)


@dataclass(slots=True)
class Sent:
    """What the requester has of the answer (read from the chunks relayed to it)."""

    text: str = ""
    #: Content chunks: tokens, on engines that stream one token per event.
    tokens: int = 0
    #: The chunks' ``id`` and ``created`` (a continuation's chunks get the same).
    chunk_id: str | None = None
    created: int | None = None
    #: A ``finish_reason`` went out: the answer was complete.
    finished: bool = False
    #: The ``usage`` chunk went out.
    usage: bool = False
    #: Why what was sent cannot be continued (tool-call deltas...), or None.
    blocked: str | None = None
    pieces: list[str] = field(default_factory=list)

    def read(self, payload: bytes) -> None:
        """Fold one relayed chunk (an OpenAI chunk's JSON) in."""
        try:
            t = _typed_chunk.decode(payload)
        except msgspec.ValidationError:  # choices of another shape: read as they are
            pass
        except msgspec.DecodeError:
            return  # not JSON (a comment relayed as data): nothing of the answer
        else:
            self.read_chunk(t.id, t.created, t.choices, t.usage)
            return
        c = _chunk.decode(payload)
        self.read_chunk(c.id, c.created, c.choices, c.usage)

    def read_chunk(self, cid: Any, created: Any, choices: Any, usage: Any) -> None:
        if self.chunk_id is None and isinstance(cid, str):
            self.chunk_id = cid
        if self.created is None and isinstance(created, int):
            self.created = created
        if usage is not None:
            self.usage = True
        if not choices:
            return
        if isinstance(choices, list) and choices and not isinstance(choices[0], ChunkChoice):
            try:
                choices = msgspec.convert(choices, list[ChunkChoice])
            except msgspec.ValidationError:
                self.blocked = self.blocked or "chunks the router cannot read"
                return
        for ch in choices:
            if ch.index not in (0, None):
                self.blocked = self.blocked or "several choices (n > 1)"
            if ch.logprobs is not None:
                self.blocked = self.blocked or "logprobs"
            d = ch.delta
            piece = ch.text
            if d is not None:
                if d.tool_calls or d.function_call:
                    self.blocked = self.blocked or "tool-call deltas"
                if d.reasoning_content or d.reasoning:
                    self.blocked = self.blocked or "reasoning deltas"
                piece = d.content
            if isinstance(piece, str) and piece:
                self.pieces.append(piece)
                self.tokens += 1
            if ch.finish_reason is not None:
                self.finished = True

    def done(self) -> Sent:
        if self.pieces:
            self.text += "".join(self.pieces)
            self.pieces = []
        return self


class Transcript:
    """The chunks relayed to the requester, as they went (blocks of SSE events, or one payload
    each): the relay appends each to :attr:`blocks` (one list append per chunk) and calls
    :meth:`fold` now and then, which reads them into a :class:`Sent` (a long answer then holds
    its text, not its chunks); :meth:`sent` reads the rest when an attempt fails."""

    __slots__ = ("blocks", "_events", "_sent")

    def __init__(self, sent: Sent | None = None) -> None:
        self.blocks: list[bytes] = []
        self._events = False  # the kind of what blocks holds
        #: ``sent``: what an earlier relay of this answer sent (a continuation's start).
        self._sent = sent if sent is not None else Sent()

    def begin(self, events: bool) -> None:
        """An attempt starts relaying ``events`` (blocks of SSE events) or payloads."""
        if events is not self._events:
            if self.blocks:
                self.fold()
            self._events = events

    def add(self, chunk: bytes) -> None:
        self.blocks.append(chunk)

    def fold(self) -> None:
        read = self._sent.read
        for block in self.blocks:
            if self._events:
                for payload in _payloads(block):
                    read(payload)
            else:
                read(block)
        self._sent.done()
        self.blocks.clear()  # in place: the relay holds its append

    def sent(self) -> Sent:
        self.fold()
        return self._sent


