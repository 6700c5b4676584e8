"""A streamed reply's relay to its HTTP client, as a sans-I/O state machine.

The loop in :mod:`zml_gateway.infer.stream` waits for the exchange's reply messages and tells
a :class:`StreamRelay` what happened; the relay answers with what to do, and keeps the
stream's state: whether the SSE head went out, the sequence check, what the client has been
sent. It imports no asyncio and no nats, so every branch is unit-tested without a network
(tests/unit/test_gateway_relay.py), as the router's ``zml_router.request.route`` is.

What happened (one method each)            What to do (the return value)
- :meth:`~StreamRelay.frames`: header-less  - ``None``: nothing, wait for the next message
  chunk frames (zmlcore.reply.streamframe)  - :class:`Start`: write the SSE answer's 200 head
- :meth:`~StreamRelay.message`: a message   - ``bytes``: write them, more follow (per chunk:
  with headers: start, chunk, events, end,    no object made for it)
  error, keepalive, "no responders"         - :class:`Finish`: the stream is over: cancel the
                                              request upstream if told, then write the last
- :meth:`~StreamRelay.overflowed`: the        bytes (none when the client is gone)
  client reads slower than the router sends - :class:`Fail`: over before the head: cancel if
- :meth:`~StreamRelay.client_gone`            told, then answer the error as any other
- :meth:`~StreamRelay.broker_lost`          - :class:`Refuse`: over before the head: the
- :meth:`~StreamRelay.failed`: its router     router's own error answer, relayed as it is
  gone, or the deadline (TIMEOUT)           - :class:`Continue`: a message was lost after the
- :meth:`~StreamRelay.lost`: a lost message   head: write what came before it, then have the
  that cannot be continued                    exchange continue the stream from there (else
                                              :meth:`~StreamRelay.lost`)

One rule ends every failed stream (:meth:`StreamRelay._stop`): before the head the client gets
the error as a plain HTTP answer; after it, as a last SSE event, since the status is sent.

What the client was sent is kept by the exchange (zmlcore.reply.resume): a stream whose router
dies is continued by another from there, numbering on, so the relay sees one stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from zmlcore import subjects
from zmlcore.errors import BackendError, StreamInterruptedError, ZMLError
from zmlcore.reply import routingmeta, streamframe
from zmlcore.reply.keepalive import keepalive_state
from zmlcore.reply.norouter import is_no_responders
from zmlcore.reply.streamseq import SeqCheck
from zml_gateway.asgi import Headers
from zml_gateway.infer.replies import broker_lost, error_answer, no_router, total_tokens

#: Stream messages that carry Zml-Seq (an error ends the stream whatever its number).
_SEQUENCED = ("start", subjects.STREAM_CHUNK, subjects.STREAM_EVENTS, subjects.STREAM_END)
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.encode


@dataclass(slots=True)
class Start:
    headers: Headers


@dataclass(slots=True)
class Finish:
    body: bytes | None  # None: write nothing (the client is gone)
    cancel: bool = False


@dataclass(slots=True)
class Fail:
    error: ZMLError
    cancel: bool = False


@dataclass(slots=True)
class Continue:
    """A stream message was lost: write ``body`` (what came before it), then have a router
    continue the stream from there (Exchange.continue_lost); if it cannot, :meth:`StreamRelay.lost`."""
    body: bytes
    error: ZMLError


@dataclass(slots=True)
class Refuse:
    status: int
    body: bytes
    headers: Headers


#: what to do next; ``bytes``: write them, more follow
Action = bytes | Start | Finish | Fail | Refuse | Continue | None


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def _before_start() -> BackendError:
    return BackendError("the router sent stream content before the stream's start; the stream is incomplete")


class StreamRelay:
    """One stream's relay. ``limits``: the x-ratelimit-* headers its answer carries."""

    __slots__ = ("limits", "started", "done", "total_tokens", "_seq")

    def __init__(self, limits: Headers) -> None:
        self.limits = limits
        #: the 200 head was sent: an error from now on is an SSE event
        self.started = False
        #: a Finish, Fail or Refuse was returned: the relay takes no more input
        self.done = False
        #: the tokens the reply used (its end message's usage), for plan limits
        self.total_tokens = 0
        self._seq = SeqCheck()  # a lost message ends the stream with an error, never silently short

    # --- what happened -------------------------------------------------------------------
    def frames(self, data: bytes, more: Callable[[], Any]) -> Action:
        """A header-less frame, and those ``more()`` hands out after it (messages already
        waiting, None when there are none): their events go out in one write."""
        body, lost = streamframe.collect(data, more, self._seq)
        if not self.started:  # a router sends its start (seq 0) first: a frame before it is garbled
            return self._stop(lost or _before_start(), cancel=True)
        if lost is not None:
            if isinstance(lost, StreamInterruptedError):  # a frame lost: continue from before it
                return Continue(body, lost)
            return self._stop(lost, cancel=True, written=body)
        return body

    def message(self, headers: dict[str, str], data: bytes) -> Action:
        """A reply message with headers (``Zml-Stream`` says its kind)."""
        if is_no_responders(headers, data):
            # The broker's "no responders" status (routers not re-subscribed yet after a
            # restart): a clean retryable error, not an empty 500. No router has it: no cancel.
            return self._stop(no_router(), cancel=False)
        kind = headers.get(subjects.H_STREAM)
        if kind is None and not data and keepalive_state(headers) is not None:
            return None  # the exchange consumes keepalives; one that gets here changes nothing
        if kind in _SEQUENCED:
            gap = self._seq.gap(headers.get(subjects.H_SEQ))
            if gap is not None:
                lost = StreamInterruptedError(f"{gap}; the stream is incomplete")
                return Continue(b"", lost) if self.started else self._stop(lost, cancel=True)
        if kind == "start":
            if self.started:
                return self._stop(BackendError("the router started the stream twice; the stream is incomplete"),
                                  cancel=True)
            self.started = True
            info = None if subjects.H_NODE_ID in headers else routingmeta.from_start(data)
            routing = routingmeta.http_headers_of(info) if info is not None else routingmeta.http_headers(headers)
            return Start([*SSE_HEADERS, *self.limits, *routing])
        if kind == subjects.STREAM_EVENTS or kind == subjects.STREAM_CHUNK or kind == subjects.STREAM_END:
            if not self.started:
                return self._stop(_before_start(), cancel=True)
            if kind == subjects.STREAM_END:
                self.done = True
                self.total_tokens = total_tokens(data)
                return Finish(DONE)
            # whole SSE events as the node framed them, or one chunk's JSON (an older router)
            return data if kind == subjects.STREAM_EVENTS else sse_event(data)
        # An error (or a non-stream reply from a router that ignored stream): the router ended it.
        self.done = True
        code = headers.get(subjects.H_ERROR_CODE, "INTERNAL")
        if not self.started:
            return Refuse(*error_answer(code, data, headers.get(subjects.H_RETRY_AFTER), self.limits))
        return Finish(sse_event(data))

    def lost(self, c: Continue) -> Action:
        """The stream a message of which was lost cannot be continued: it ends with the loss."""
        return self._stop(c.error, cancel=True)

    def overflowed(self, buffer: int) -> Action:
        """The exchange's buffer of ``buffer`` messages overflowed: the client reads too slowly."""
        return self._stop(BackendError(f"client read too slowly: more than {buffer} chunks waiting; "
                                       "request cancelled"), cancel=True)

    def client_gone(self) -> Action:
        """The HTTP client went away: the request is cancelled, nothing more is written."""
        self.done = True
        return Finish(None, cancel=True)

    def broker_lost(self) -> Action:
        """The broker connection was lost: messages sent meanwhile are lost with it."""
        if self.started:
            return self._stop(StreamInterruptedError("the broker connection was lost mid-stream; "
                                                     "the stream is incomplete"), cancel=True)
        return self._stop(broker_lost(), cancel=True)

    def failed(self, error: ZMLError) -> Action:
        """The wait for the next message failed: its router is gone (BACKEND_ERROR, or
        STREAM_INTERRUPTED once relaying) or the request's deadline passed (TIMEOUT)."""
        return self._stop(error, cancel=True)

    # --- the one way a failed stream ends --------------------------------------------------
    def _stop(self, error: ZMLError, *, cancel: bool, written: bytes = b"") -> Finish | Fail:
        """Before the head: answer ``error`` as any other error. After: the events still to
        write (``written``), then ``error`` as the stream's last event."""
        self.done = True
        if not self.started:
            return Fail(error, cancel)
        return Finish(written + sse_event(_encode(error.to_body())), cancel)
