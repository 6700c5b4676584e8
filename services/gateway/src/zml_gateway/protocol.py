"""uvicorn's httptools protocol with bounds on the request head.

httptools (llhttp) limits neither the number nor the size of headers, and uvicorn adds no limit
of its own for it (h11 has ``h11_max_incomplete_event_size``; httptools has nothing), so a
client could send a 64 MiB header, or 10,000 of them, or trickle one byte every few seconds
for ever (slow loris). Here:

- more than ``max_header_bytes`` received without the head being complete -> 431, close;
- more than ``max_headers`` header lines -> 431, close;
- the head not complete ``header_timeout_s`` after the request began -> 408, close.

Bytes are counted before httptools buffers them, so memory per connection stays under
``max_header_bytes`` plus one read.

Each request's cycle is a :class:`FastCycle`: a response that declares its length goes out in
one write (head and body), and the app can ask to be called back when the client goes away
(:meth:`FastCycle.on_disconnect`) instead of keeping a task in ``receive()``.

uvicorn documents neither class subclassed here: they come from
:mod:`zml_gateway.uvicorninternals`, which checks at start-up that what this module relies on is
there.

A connection whose first bytes are the HTTP/2 client preface (h2c with prior knowledge, or
TLS after ALPN chose ``h2``) is handed to :class:`zml_gateway.http2.H2Protocol`, which serves
the same app with the same bounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from zmlcore.errors import BadRequestError, HeadersTooLargeError
from zml_gateway.http2 import PREFACE, H2Limits, H2Protocol
from zml_gateway.uvicorninternals import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a refused request."""


def _response(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))) + body


class _Head:
    """Stands in for the transport while uvicorn writes a response head: keeps the bytes."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


class FastCycle(RequestResponseCycle):
    """uvicorn's request/response cycle, with costs per request cut (at C=1 they are paid on
    the request's critical path, and by the client too):

    - a response with a ``content-length`` goes out in one write: uvicorn builds and checks
      the head as always, but it is held until the body (which the app sends right after) and
      written with it. One syscall and one TCP segment instead of two.
    - :meth:`on_disconnect`: the protocol calls back when the connection is lost, so the app
      needs no task parked in ``receive()`` per request to learn it.
    - :attr:`body_complete`: the app reads a body that is all here without arming a timer.
    - the head of such a response is built here (:meth:`_whole_head`), with uvicorn's own
      checks made once over all names and once over all values instead of twice per header
      (a reply carries ~16: its routing metadata, rate limits): ~8% of the gateway's CPU per
      request. So is a stream's (no length: chunked), which carries as many (~40 regex searches
      per stream in uvicorn), held until its first chunk when that comes in the same turn of the
      event loop (the router's start and first events arrive together): one write for both, and
      written at the end of that turn when it does not. Any other head (``connection`` or
      ``transfer-encoding`` set, upper-case names, an access log, an invalid byte, 204/304) is
      uvicorn's, as before.
    """

    _held: bytes | None = None
    _gone: list[Callable[[], None]] | None = None

    @property
    def body_complete(self) -> bool:
        """The whole request body has arrived (``receive()`` will not wait for the client)."""
        return not self.more_body

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once if the client goes away before the response is complete
        (at once if it has already); returns what cancels that."""
        if self.disconnected:
            callback()
            return _nothing
        gone = self._gone
        if gone is None:
            gone = self._gone = []
        gone.append(callback)

        def cancel() -> None:
            try:
                gone.remove(callback)
            except ValueError:
                pass
        return cancel

    def lost(self) -> None:
        """The connection is gone (the protocol's connection_lost)."""
        gone, self._gone = self._gone, None
        if gone and self.disconnected:
            for callback in gone:
                callback()

    async def send(self, message: Any) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:  # as uvicorn: writes go nowhere
                return
            if self.chunked_encoding:  # a stream's head: with its first chunk, in one write
                body = message.get("body", b"")
                if message["type"] == "http.response.body" and body and message.get("more_body", False):
                    self.transport.write(b"%s%x\r\n%s\r\n" % (held, len(body), body))
                    return
            elif (message["type"] == "http.response.body" and not message.get("more_body", False)
                    and len(message.get("body", b"")) == self.expected_content_length):
                self.transport.write(held + message.get("body", b""))
                self.expected_content_length = 0
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()
                return
            self.transport.write(held)  # anything else: the head now, then as uvicorn does
            await super().send(message)
            return
        if self.response_started or message["type"] != "http.response.start":
            await super().send(message)
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # here, so that nothing awaits while the transport is swapped
        if self.disconnected:
            return
        whole = self._whole_head(message)
        if whole is not None:
            self._held = whole  # its body follows: one write for both
            if self.chunked_encoding:  # a stream: its first chunk may not be here yet
                asyncio.get_running_loop().call_soon(self._write_held)
            return
        transport, head = self.transport, _Head()
        self.transport = head  # type: ignore[assignment]
        try:
            await super().send(message)  # uvicorn checks and builds the head
        finally:
            self.transport = transport
        if not head.data:  # not written (the client is gone)
            return
        if self.chunked_encoding is False and self.expected_content_length > 0 and self.scope["method"] != "HEAD":
            self._held = head.data  # its body follows: one write for both
        else:
            transport.write(head.data)


    def _whole_head(self, message: Any) -> bytes | None:
        """The head of a response with a ``content-length`` and a body to follow, or of a stream
        (no length: chunked), as uvicorn would write it (the response then counts as started),
        or None: uvicorn writes it."""
        if self.access_log or self.chunked_encoding is not None \
                or self.scope["method"] == "HEAD":
            return None
        headers = message.get("headers", ())
        default = self.default_headers
        if default:
            headers = [*default, *headers]
        names = b"".join([n for n, _ in headers])
        # uvicorn's per-header checks, made over all at once (each is a class of single bytes);
        # lower-case names only (uvicorn lower-cases them); the rest is uvicorn's.
        if (HEADER_RE.search(names) or HEADER_VALUE_RE.search(b"".join([v for _, v in headers]))
                or not names.islower() or b"connection" in names or b"transfer-encoding" in names):
            return None
        length = None
        status = message["status"]
        content = [STATUS_LINE[status]]
        for name, value in headers:
            if name == b"content-length" and length is None:
                length = value
            content += (name, b": ", value, b"\r\n")
        if length is None:  # a stream (SSE): uvicorn's chunked framing
            if status in (204, 304):
                return None
        elif not length.isdigit() or int(length) <= 0:
            return None
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        if length is None:
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.response_started = True
        self.waiting_for_100_continue = False
        if length is None:
            self.chunked_encoding = True
        else:
            self.expected_content_length = int(length)
            self.chunked_encoding = False
        return b"".join(content)

    def _write_held(self) -> None:
        """A stream's head whose first chunk did not follow in the same turn of the loop: now."""
        held, self._held = self._held, None
        if held is not None and not self.disconnected:
            self.transport.write(held)


def _nothing() -> None:
    pass


class BoundedHttpTools(HttpToolsProtocol):
    max_header_bytes = 16 * 1024
    max_headers = 100
    header_timeout_s = 10.0
    h2_limits: H2Limits | None = H2Limits()  # None: HTTP/1.1 only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_count = 0
        self._head_size = 0
        self._in_head = True
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_deadline = 0.0
        self._sniff = b"" if self.h2_limits is not None else None  # first bytes, until told h1 from h2

    @classmethod
    def with_limits(cls, max_header_bytes: int, max_headers: int, header_timeout_s: float,
                    h2_limits: H2Limits | None = None) -> type[BoundedHttpTools]:
        return type("BoundedHttpTools", (cls,), {"max_header_bytes": max_header_bytes, "max_headers": max_headers,
                                                 "header_timeout_s": header_timeout_s, "h2_limits": h2_limits})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)
        if isinstance(self.cycle, FastCycle):
            self.cycle.lost()

    def _start_head(self) -> None:
        self._in_head = True
        self._head_bytes = self._head_count = self._head_size = 0
        self._head_deadline = self.loop.time() + self.header_timeout_s
        # One timer per connection, not one armed and cancelled per request: a timer armed for
        # an earlier head fires sooner than this deadline and re-arms for it (_head_timeout).
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timeout)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self._refused:
            return
        if self._head_deadline - self.loop.time() > 0.005:  # a later request's head: wait for its deadline
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timeout)
            return
        self._refuse(_response(408, b"Request Timeout",
                               f"request headers not received within {self.header_timeout_s:g} s",
                               BadRequestError.code))

    def _refuse(self, response: bytes) -> None:
        self._refused = True
        self._stop_timer()
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()

    def _too_large(self, what: str) -> None:
        self._refuse(_response(431, b"Request Header Fields Too Large", what, HeadersTooLargeError.code))

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._sniff is not None:
            data = self._sniff + data
            if PREFACE.startswith(data[:24]) and len(data) < 24:
                self._sniff = data  # a prefix of the preface: wait for more (the head timer runs)
                return
            self._sniff = None
            if data[:24] == PREFACE:
                self._to_http2(data)
                return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and not self._refused and self._head_bytes > self.max_header_bytes:
            self._too_large(f"request line and headers larger than {self.max_header_bytes} bytes")

    def _to_http2(self, data: bytes) -> None:
        """Hand this connection to the HTTP/2 protocol (same app, transport and server state)."""
        assert self.h2_limits is not None
        self._stop_timer()
        self.connections.discard(self)
        h2p = H2Protocol(self.app, self.server_state, self.server_state.default_headers, self.h2_limits,
                         self.client, self.server, self.scheme or "http", self.loop)
        self.transport.set_protocol(h2p)
        h2p.connection_made(self.transport)
        h2p.data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # not after our own refusal (raised from a callback to stop parsing)
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # a pipelined or keep-alive request: its head is bounded afresh
            self._start_head()
        self._head_size = self._head_count = 0

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Exact size of the parsed head (a whole request can arrive in one read, where the
        # byte count in data_received cannot tell head from body).
        self._head_count += 1
        self._head_size += len(name) + len(value) + 4
        if self._head_count > self.max_headers:
            self._too_large(f"more than {self.max_headers} request headers")
            raise _Refused
        if self._head_size > self.max_header_bytes:
            self._too_large(f"request line and headers larger than {self.max_header_bytes} bytes")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False  # the head timer, if it fires, finds nothing to do
        before = self.cycle
        super().on_headers_complete()
        # uvicorn has just built this request's cycle, and created (or queued, when pipelined)
        # its ASGI task, which has not run yet: the cycle becomes a FastCycle, a subclass that
        # adds no state of its own. (Not uvicorn's private _start_asgi_task, which only
        # uvicorn >= 0.45 has; zml_gateway.uvicorninternals checks what this relies on.)
        cycle = self.cycle
        if cycle is not before and type(cycle) is RequestResponseCycle:
            cycle.__class__ = FastCycle
