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

A connection whose first bytes are the HTTP/2 client preface (h2c with prior knowledge, or
TLS after ALPN chose ``h2``) is handed to :class:`zml_gateway.http2.H2Protocol`, which serves
the same app with the same bounds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from zmlcore.errors import BadRequestError, HeadersTooLargeError
from zml_gateway.http2 import PREFACE, H2Limits, H2Protocol


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing a refused request."""


def _response(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error", "code": code}})
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))) + body


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

    def _start_head(self) -> None:
        self._in_head = True
        self._head_bytes = self._head_count = self._head_size = 0
        self._stop_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._in_head and not self._refused:
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
        self._in_head = False
        self._stop_timer()
        super().on_headers_complete()
