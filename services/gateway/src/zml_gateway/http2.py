"""HTTP/2 for the gateway's port: the ``h2`` state machine driving the same ASGI app as HTTP/1.1.

The HTTP/1.1 protocol (:mod:`zml_gateway.protocol`) looks at the first bytes of a connection;
when they are the HTTP/2 client preface (h2c with prior knowledge, or TLS after ALPN chose
``h2``), it hands the transport to :class:`H2Protocol`. HTTP/1.1 keeps httptools and pays one
prefix check per connection.

Bounds (the HTTP/1.1 ones, plus what HTTP/2 adds):

- header list: more than ``max_header_bytes`` (name + value + 32 per field, RFC 9113) or more
  than ``max_headers`` fields -> 431 on that stream; four times the size is refused while
  decoding (GOAWAY ENHANCE_YOUR_CALM) so a header block is never held in full beyond that;
- ``max_streams`` concurrent streams (SETTINGS_MAX_CONCURRENT_STREAMS; more is a protocol error);
- request bodies: a stream's window reopens only as the app reads, so a connection buffers at
  most its 1 MiB connection window; the app answers 413 past ``max_body_bytes``;
- time: the first request must arrive within ``header_timeout_s``, an idle connection (no open
  stream) is closed after ``idle_timeout_s`` with GOAWAY;
- floods: stream resets by the client (rapid reset, CVE-2023-44487) and control frames
  (SETTINGS, PING, PRIORITY, empty DATA, unknown frames) each draw on a token bucket; an empty
  bucket ends the connection with GOAWAY ENHANCE_YOUR_CALM. Reading stops while the socket's
  write buffer is full, so queued PING/SETTINGS acknowledgements cannot grow memory;
- malformed frames or headers -> GOAWAY (PROTOCOL_ERROR etc., as h2 decides), never a 5xx.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections import deque
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import msgspec
from h2.errors import ErrorCodes

from zmlcore.errors import HeadersTooLargeError

log = logging.getLogger("zml.gateway")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_CONNECTION_WINDOW = 1024 * 1024
_DRAIN = 16 * 1024 * 1024  # request body read and dropped after an early answer, before RST_STREAM
# Headers HTTP/2 forbids (RFC 9113 8.2.2); an app may set them for HTTP/1.1.
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_CONTROL = (h2.events.RemoteSettingsChanged, h2.events.PingReceived, h2.events.PriorityUpdated,
            h2.events.UnknownFrameReceived, h2.events.PingAckReceived)


class H2Limits(msgspec.Struct, frozen=True):
    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_streams: int = 100
    resets_per_s: float = 100.0
    """Client stream resets refilled per second (bucket of twice that)."""
    control_per_s: float = 500.0
    """Control frames refilled per second (bucket of twice that)."""


class _Bucket:
    __slots__ = ("rate", "cap", "tokens", "at")

    def __init__(self, rate: float) -> None:
        self.rate, self.cap, self.tokens, self.at = rate, 2 * rate, 2 * rate, time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.cap, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1
        return self.tokens >= 0


class _Stream:
    __slots__ = ("id", "chunks", "ended", "body_done", "closed", "event", "window", "started", "complete", "task")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.chunks: deque[tuple[bytes, int]] = deque()  # (data, flow-controlled length)
        self.ended = False  # the client's side is done (END_STREAM)
        self.body_done = False  # the app was given the body's last part
        self.closed = False  # reset, or the connection is gone
        self.event = asyncio.Event()  # request data arrived, or closed
        self.window = asyncio.Event()  # send window may have opened
        self.started = False
        self.complete = False
        self.task: asyncio.Task[None] | None = None


def _error_body(message: str, code: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error", "code": code}})


class H2Protocol(asyncio.Protocol):
    """One HTTP/2 connection. Built by the HTTP/1.1 protocol that received the preface, with
    its app, server state (uvicorn's connection and task sets, for graceful shutdown) and
    addresses."""

    def __init__(self, app: Any, server_state: Any, default_headers: list[tuple[bytes, bytes]], limits: H2Limits,
                 client: Any, server: Any, scheme: str, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.state = server_state
        self.default_headers = default_headers
        self.limits = limits
        self.client, self.server, self.scheme, self.loop = client, server, scheme, loop
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_bytes,
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
        })
        # Decoding stops (DenialOfServiceError) well past the advertised size; between the two, 431.
        self.conn.decoder.max_header_list_size = 4 * limits.max_header_bytes
        self.streams: dict[int, _Stream] = {}
        self.draining: dict[int, int] = {}  # stream answered early -> body bytes still accepted
        self.transport: asyncio.Transport | None = None
        self.resets = _Bucket(limits.resets_per_s)
        self.control = _Bucket(limits.control_per_s)
        self.writable = asyncio.Event()
        self.writable.set()
        self.closing = False
        self.timer: asyncio.TimerHandle | None = None
        self.flush_soon = False

    # -- transport callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state.connections.add(self)
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(_CONNECTION_WINDOW - 65535)
        self._flush()
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        self.closing = True
        self._disarm()
        self.writable.set()
        for stream in self.streams.values():
            stream.closed = True
            stream.event.set()
            stream.window.set()

    def pause_writing(self) -> None:
        # Stop reading too: no new frames (and no queued acknowledgements) until the client reads.
        self.writable.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool | None:
        return None

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: no new streams; close once the open ones finish."""
        if not self.closing:
            self.closing = True
            self.conn.close_connection()
            self._write_now()
        if not self.streams and self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.DenialOfServiceError:
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM)
            return
        except h2.exceptions.ProtocolError:  # h2 has queued the GOAWAY with its error code
            self._write_now()
            self._close()
            return
        except Exception:  # a bug in h2 or here must not kill the process: end this connection
            log.exception("HTTP/2 connection failed")
            self._goaway(ErrorCodes.INTERNAL_ERROR)
            return
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                self._request(event)
            elif isinstance(event, h2.events.DataReceived):
                self._data(event)
            elif isinstance(event, h2.events.StreamEnded):
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.ended = True
                    stream.event.set()
            elif isinstance(event, h2.events.StreamReset):
                self.draining.pop(event.stream_id, None)
                self._reset(event.stream_id)
                if event.remote_reset and not self.resets.take():
                    self._goaway(ErrorCodes.ENHANCE_YOUR_CALM)
                    return
            elif isinstance(event, h2.events.WindowUpdated):
                if event.stream_id == 0:
                    for stream in self.streams.values():
                        stream.window.set()
                elif (stream := self.streams.get(event.stream_id)) is not None:
                    stream.window.set()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closing = True
                self._close()
                return
            elif isinstance(event, h2.events.TrailersReceived):  # not part of this API
                self._reset(event.stream_id, ErrorCodes.PROTOCOL_ERROR)
            if isinstance(event, _CONTROL) and not self.control.take():
                self._goaway(ErrorCodes.ENHANCE_YOUR_CALM)
                return
        self._flush()

    # -- events --------------------------------------------------------------------------------

    def _request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if self.closing:
            self._reset(sid, ErrorCodes.REFUSED_STREAM)
            return
        self._disarm()
        stream = _Stream(sid)
        self.streams[sid] = stream
        if event.stream_ended is not None:
            stream.ended = True
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        size = 0
        for name, value in event.headers:
            size += len(name) + len(value) + 32
            if name[:1] == b":":
                pseudo[name] = value
            else:
                headers.append((name, value))
        limits = self.limits
        if len(event.headers) > limits.max_headers or size > limits.max_header_bytes:
            what = (f"more than {limits.max_headers} request headers" if len(event.headers) > limits.max_headers
                    else f"request headers larger than {limits.max_header_bytes} bytes")
            self._answer(stream, 431, _error_body(what, HeadersTooLargeError.code))
            return
        method = pseudo.get(b":method", b"GET").decode("ascii", "replace")
        target = pseudo.get(b":path", b"/")
        authority = pseudo.get(b":authority")
        if authority is not None and not any(n == b"host" for n, _ in headers):
            headers.insert(0, (b"host", authority))
        raw_path, _, query = target.partition(b"?")
        path = raw_path.decode("ascii", "replace")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "2",
            "server": self.server, "client": self.client, "scheme": self.scheme, "method": method,
            "root_path": "", "path": path, "raw_path": raw_path, "query_string": query, "headers": headers,
        }
        stream.task = task = self.loop.create_task(self._run(stream, scope))
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    def _data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if not event.data and not event.stream_ended and not self.control.take():  # empty-DATA flood
            self._goaway(ErrorCodes.ENHANCE_YOUR_CALM)
            return
        if stream is None or stream.complete:  # answered already: give the window back, drop the bytes
            left = self.draining.get(event.stream_id)
            if left is not None:
                left -= event.flow_controlled_length
                if event.stream_ended is not None:
                    del self.draining[event.stream_id]
                elif left < 0:
                    del self.draining[event.stream_id]
                    self._reset(event.stream_id, ErrorCodes.CANCEL)
                    return
                else:
                    self.draining[event.stream_id] = left
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        stream.chunks.append((event.data, event.flow_controlled_length))
        if event.stream_ended is not None:
            stream.ended = True
        stream.event.set()

    def _reset(self, sid: int, code: ErrorCodes | None = None) -> None:
        if code is not None:
            try:
                self.conn.reset_stream(sid, code)
            except h2.exceptions.H2Error:
                pass
        stream = self.streams.get(sid)
        if stream is not None:
            stream.closed = True
            stream.event.set()
            stream.window.set()
            self._release(stream)

    # -- the ASGI side -------------------------------------------------------------------------

    async def _run(self, stream: _Stream, scope: dict[str, Any]) -> None:
        async def receive() -> dict[str, Any]:
            while True:
                if stream.closed:
                    return {"type": "http.disconnect"}
                if stream.chunks:
                    data, length = stream.chunks.popleft()
                    if length:  # read: the client may send that much more
                        try:
                            self.conn.acknowledge_received_data(length, stream.id)
                            self._flush()
                        except h2.exceptions.H2Error:
                            pass
                    more = bool(stream.chunks) or not stream.ended
                    stream.body_done = not more
                    return {"type": "http.request", "body": data, "more_body": more}
                if stream.ended and not stream.body_done:
                    stream.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                if stream.complete:  # after the response, as uvicorn does
                    return {"type": "http.disconnect"}
                stream.event.clear()
                await stream.event.wait()

        send = self._sender(stream)
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("exception in ASGI app (HTTP/2)")
            if not stream.started and not stream.closed:
                await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"Internal Server Error"})
            elif not stream.complete:
                self._reset(stream.id, ErrorCodes.INTERNAL_ERROR)
                self._flush()
        finally:
            if not stream.complete and not stream.closed:  # the app returned without finishing
                self._reset(stream.id, ErrorCodes.INTERNAL_ERROR)
                self._flush()
            self._release(stream)

    def _sender(self, stream: _Stream) -> Any:
        pending: list[tuple[bytes, bytes]] = []

        async def send(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                if stream.started:
                    raise RuntimeError("response already started")
                stream.started = True
                status = message["status"]
                out = [(b":status", str(status).encode())]
                out += [(n.lower(), v) for n, v in message.get("headers", ()) if n.lower() not in _HOP]
                out += self.default_headers
                pending[:] = out
                return
            if kind != "http.response.body":
                return
            if not stream.started or stream.complete:
                raise RuntimeError("response body before start, or after the end")
            if stream.closed:
                return  # the client is gone: the app learns it from receive()
            data = message.get("body", b"")
            more = message.get("more_body", False)
            try:
                if pending:
                    self.conn.send_headers(stream.id, pending, end_stream=not data and not more)
                    pending.clear()
                    if not data and not more:
                        self._finish(stream)
                        return
                await self._send_data(stream, data, end=not more)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                stream.closed = True
                return
            if not more:
                self._finish(stream)

        return send

    async def _send_data(self, stream: _Stream, data: bytes, end: bool) -> None:
        view = memoryview(data)
        while True:
            if stream.closed:
                return
            if not self.writable.is_set():
                self._flush()
                await self.writable.wait()
                continue
            if not view:
                if end:
                    self.conn.end_stream(stream.id)
                self._flush()
                return
            window = min(self.conn.local_flow_control_window(stream.id), self.conn.max_outbound_frame_size)
            if window <= 0:
                self._flush()
                stream.window.clear()
                await stream.window.wait()
                continue
            chunk, view = view[:window], view[window:]
            self.conn.send_data(stream.id, bytes(chunk), end_stream=end and not view)
            if end and not view:
                self._flush()
                return

    def _finish(self, stream: _Stream) -> None:
        stream.complete = True
        if not stream.ended and not stream.closed:
            # Answered before the whole body came (413, 431). RFC 9113 8.1 allows RST_STREAM
            # NO_ERROR here, but some clients (httpx) then wait for window on the dead stream:
            # read and drop up to _DRAIN more bytes instead, then reset.
            self.draining[stream.id] = _DRAIN
        self._flush()
        stream.event.set()  # a receive() waiting for disconnect: the response is done
        self._release(stream)

    def _answer(self, stream: _Stream, status: int, body: bytes) -> None:
        stream.started = True
        headers = [(b":status", str(status).encode()), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *self.default_headers]
        try:
            self.conn.send_headers(stream.id, headers)
            self.conn.send_data(stream.id, body, end_stream=True)
        except h2.exceptions.H2Error:
            pass
        self._finish(stream)

    def _release(self, stream: _Stream) -> None:
        """A stream whose response is done (or that was reset) and whose task has returned is
        forgotten; its unread body is handed back to the connection window."""
        if not (stream.complete or stream.closed):
            return
        if stream.task is not None and not stream.task.done() and asyncio.current_task() is not stream.task:
            return
        if self.streams.pop(stream.id, None) is None:
            return
        unread = sum(length for _, length in stream.chunks)
        stream.chunks.clear()
        if unread:
            try:
                self.conn.acknowledge_received_data(unread, stream.id)
                self._flush()
            except h2.exceptions.H2Error:
                pass
        if not self.streams:
            if self.closing and self.transport is not None:
                self._write_now()
                self.transport.close()
            else:
                self._arm(self.limits.idle_timeout_s)

    # -- connection ----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Write what h2 has queued, once per loop iteration: a response's HEADERS and DATA, the
        window update for its body and the frames of other streams leave in one write."""
        if not self.flush_soon:
            self.flush_soon = True
            self.loop.call_soon(self._write_now)

    def _write_now(self) -> None:
        self.flush_soon = False
        data = self.conn.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _goaway(self, code: ErrorCodes) -> None:
        try:
            self.conn.close_connection(code)
        except h2.exceptions.H2Error:
            pass
        self._write_now()
        self._close()

    def _close(self) -> None:
        self.closing = True
        self._disarm()
        if self.transport is not None:
            self.transport.close()
        for stream in self.streams.values():
            stream.closed = True
            stream.event.set()
            stream.window.set()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._timeout)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timeout(self) -> None:
        self.timer = None
        if not self.streams:  # idle (or no first request in time): say goodbye
            self._goaway(ErrorCodes.NO_ERROR)
