"""Streams, sans-I/O: one :class:`StreamEvent` (start with routing, chunk, end, error) per piece
of a streamed reply, whichever way it came: the gateway's SSE lines (:class:`SSEDecoder`), a
router's NATS messages (:func:`decode_nats_stream`) or its header-less chunk frames
(:func:`decode_nats_frame`, lost frames detected by sequence number).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from zml._core.reply import RawReply, decode_error, int_or, nats_status, routing_from_dict, usage_of
from zml._core.retry import no_router_error
from zml._errors import BackendError, ErrorBody, StreamInterruptedError, ZMLError, from_wire
from zml._models import Routing, StreamChunk, Usage
from zmlcore import subjects
from zmlcore.reply import streamframe
from zmlcore.reply.sse import SSELineSplitter, data_field
from zmlcore.reply.streamseq import SeqCheck

__all__ = ["SSEDecoder", "StreamEvent", "decode_chunk", "decode_nats_frame", "decode_nats_stream"]

@dataclass(slots=True)
class StreamEvent:
    kind: Literal["start", "chunk", "end", "error"]
    chunk: StreamChunk | None = None
    routing: Routing | None = None
    error: ZMLError | None = None
    usage: Usage | None = None


def decode_chunk(data: Any) -> StreamEvent:
    """One OpenAI chunk (chat ``delta.content`` or completions ``text``), or one event of a
    streamed transcription (``transcript.text.delta``'s ``delta``; ``transcript.text.done`` ends
    it with finish reason ``stop``)."""
    if not isinstance(data, dict):
        return StreamEvent("chunk", chunk=StreamChunk(text=""))
    if "error" in data and "choices" not in data:
        return StreamEvent("error", error=_error_from_obj(data))
    kind = data.get("type")
    if kind == "transcript.text.delta":
        delta = data.get("delta")
        return StreamEvent("chunk", chunk=StreamChunk(text=delta if isinstance(delta, str) else "", raw=data))
    if kind == "transcript.text.done":
        return StreamEvent("chunk", chunk=StreamChunk(text="", finish_reason="stop", raw=data))
    text, index, finish = "", 0, None
    choices = data.get("choices") or []
    if choices and isinstance(choices[0], Mapping):
        ch = choices[0]
        delta = ch.get("delta")
        piece = delta.get("content") if isinstance(delta, Mapping) else ch.get("text")
        text = piece if isinstance(piece, str) else ""
        index, finish = int_or(ch.get("index")), ch.get("finish_reason")
    usage = usage_of(data["usage"]) if isinstance(data.get("usage"), Mapping) else None
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

