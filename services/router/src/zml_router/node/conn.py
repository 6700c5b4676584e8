"""One keep-alive HTTP/1.1 connection to a node: an ``asyncio.Protocol`` with httptools'
(llhttp) response parser, and the reads of its reply (zml_router.node.client pools them).

A reply is read whole (the body gathered in the protocol up to a bound, one wake-up per call)
or streamed (the head, then each read as it comes, with flow control: the socket stops being
read past ``_HIGH_WATER`` buffered bytes). Every way the node's HTTP can go wrong (reset, early
close, malformed status line or framing, a head over the bounds) is a :class:`NodeHTTPError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import httptools

#: Bounds on a reply's head: the status line and all header lines together, and their count.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
#: Body bytes buffered from a streamed reply before the socket stops being read.
_HIGH_WATER = 1 << 20
#: Bytes a stream released after [DONE] may still receive before its body's end.
LINGER_BYTES = 64 * 1024


class NodeHTTPError(Exception):
    """The node's HTTP failed: connect, reset, early close, malformed or oversized head."""


class Stale(NodeHTTPError):
    """A reused connection closed before any byte of the reply: the node dropped it while idle."""


class Pool(Protocol):
    """What a connection asks of the pool that holds it (``zml_router.node.client.NodeHTTP``)."""

    loop: asyncio.AbstractEventLoop
    #: Bytes read of a non-2xx reply's body.
    error_limit: int

    def close(self, conn: Conn) -> None:
        """Abort the connection and stop counting it."""

    def forget(self, conn: Conn) -> None:
        """The connection is gone (closed by either side): stop counting it."""

    def park(self, conn: Conn) -> None:
        """The reply was read to its end on a connection the node keeps open: reuse it."""


class Conn(asyncio.Protocol):
    """One connection and the reply being read on it."""

    __slots__ = ("pool", "key", "transport", "parser", "closed", "counted", "reused", "whole", "limit",
                 "status", "headers", "nheaders", "head_bytes", "head_fed", "body", "on_body", "buffered", "over",
                 "framed", "headers_done", "complete", "keep_alive", "got_bytes", "error", "waiter",
                 "paused", "in_use", "lingering", "idle_since")

    def __init__(self, pool: Pool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.counted = True  # counts towards the pool's bound until closed
        self.reused = False
        self.in_use = True
        self.lingering = False  # released after [DONE], the end of the body still to come
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.error: Exception | None = None
        self._new_reply(False, 0)

    def _new_reply(self, whole: bool, limit: int) -> None:
        self.body: list[bytes] = []
        # httptools calls ``on_body`` once per body chunk (an SSE reply: once per event) and
        # looks it up when the parser is made: the list's own append, with no Python frame per
        # chunk; what one read added is accounted for after it (_took).
        self.on_body = self.body.append
        self.parser = httptools.HttpResponseParser(self)
        self.whole = whole  # gather the body, wake once at the end (or at the bound)
        self.limit = limit
        self.status = 0
        self.headers: dict[str, str] = {}
        self.nheaders = 0
        self.head_bytes = 0
        self.head_fed = 0  # bytes fed while the head was incomplete (llhttp buffers a partial line)
        self.buffered = 0
        self.over = False  # the body passed the bound: the rest is not read
        self.framed = False  # content-length or chunked: the end is not the connection's close
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.complete or self.over:
            if self.complete and not self.over:
                self.pool.close(self)  # bytes after the end of the reply (or while idle): not reused
            return
        body = self.body
        before = len(body)
        lingering = self.lingering
        try:
            self.parser.feed_data(data)
            if not self.headers_done:
                self.head_fed += len(data)
                if self.head_fed > MAX_HEAD_BYTES:
                    raise NodeHTTPError(f"reply head over {MAX_HEAD_BYTES} bytes")
        except NodeHTTPError as exc:
            self._abort(exc)
        except httptools.HttpParserUpgrade:
            self._abort(NodeHTTPError("the node answered with a protocol upgrade"))
        except httptools.HttpParserCallbackError as exc:
            self._abort(exc.__context__ if isinstance(exc.__context__, NodeHTTPError) else NodeHTTPError(str(exc)))
        except httptools.HttpParserError as exc:
            self._abort(NodeHTTPError(f"malformed HTTP reply: {exc}"))
        if len(body) > before:
            self._took(body, before, lingering)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed by the pool: nothing more to learn
            if not self.complete and self.error is None:
                self.error = NodeHTTPError("connection closed")
            self._wake()
            self.pool.forget(self)
            return
        self.closed = True
        if self.headers_done and not self.framed and not self.complete and self.error is None:
            self.complete = True  # a body delimited by the close (no length, not chunked)
        elif not self.complete and self.error is None:
            cls = Stale if (self.reused and not self.got_bytes) else NodeHTTPError
            self.error = cls(f"the node closed the connection{'' if exc is None else f': {exc}'}")
        self._wake()
        self.pool.forget(self)

    def pause_writing(self) -> None:  # the body is written whole; the transport buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.head_bytes += len(status)
        if self.head_bytes > MAX_HEAD_BYTES:
            raise NodeHTTPError(f"reply status line over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called per line (llhttp joins a line split across reads before calling).
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            raise NodeHTTPError(f"reply headers over {MAX_HEAD_BYTES} bytes")
        self.nheaders += 1
        if self.nheaders > MAX_HEADERS:
            raise NodeHTTPError(f"reply with over {MAX_HEADERS} headers")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: informational, the real reply follows
            self.headers = {}
            self.nheaders = 0
            return
        self.status = status
        h = self.headers
        self.framed = "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower() \
            or status in (204, 304)
        self.headers_done = True
        if self.whole:
            if status >= 300:
                self.limit = min(self.limit, self.pool.error_limit)
        else:
            self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return  # the end of a 1xx
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.lingering:
            self.lingering = False
            if self.keep_alive:
                self.pool.park(self)
            else:
                self.pool.close(self)
        self._wake()

    def _took(self, body: list[bytes], before: int, lingering: bool) -> None:
        """The body chunks one read appended to ``body`` (from index ``before``), counted and
        bounded as they came: a reply released after [DONE] (``lingering`` when the read began)
        counts them and keeps none; a whole reply keeps ``limit`` bytes and stops reading
        there; a streamed one stops reading past ``_HIGH_WATER`` and wakes its reader."""
        new = body[before:]
        size = sum(map(len, new))
        if lingering:
            del body[before:]
            self.buffered += size
            if self.buffered > LINGER_BYTES:
                self.pool.close(self)
            return
        n = self.buffered + size
        if self.whole and n > self.limit:
            del body[before:]
            kept = b"".join(new)[: self.limit - self.buffered]
            if kept:
                body.append(kept)
            self.buffered = self.limit
            self.over = True
            self._pause()
            self._wake()
            return
        self.buffered = n
        if not self.whole:
            if n > _HIGH_WATER:
                self._pause()
            if self.waiter is not None:  # (woken once per read, however many chunks it held)
                self._wake()

    # -- used by the pool and replies --------------------------------------------------------

    def _pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None  # woken once: what else comes before the reader runs needs no call
            if not w.done():
                w.set_result(None)

    def _abort(self, err: Exception) -> None:
        if self.complete:  # bytes past the end of a reply: it stands, the connection goes
            self.pool.close(self)
            return
        if self.error is None:
            self.error = err
        self._wake()
        self.pool.close(self)

    async def wait(self) -> None:
        """Until the parser has news (headers, body, end) or the connection failed."""
        if self.error is not None:
            raise self.error
        self.waiter = self.pool.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None and not self.complete:
            raise self.error


async def read_body(conn: Conn, limit: int) -> bytes:
    """Up to ``limit`` bytes of a streamed reply's body (for a whole reply, what was gathered)."""
    while not conn.complete and conn.buffered < limit:
        await _more(conn)
    data = b"".join(conn.body)
    conn.body.clear()
    if len(data) > limit:
        data = data[:limit]
        conn.over = True
    return data


async def _more(conn: Conn) -> None:
    if conn.paused and not conn.closed:
        conn.paused = False
        conn.transport.resume_reading()  # type: ignore[union-attr]
    await conn.wait()


#: Until a streamed reply has news (body, end) or its connection failed (raised).
more_body = _more


def take_body(conn: Conn) -> bytes:
    """What a streamed reply's body has buffered since the last take (b"": nothing)."""
    body = conn.body
    if not body:
        return b""
    if len(body) == 1:
        data = body.pop()
    else:
        data = b"".join(body)
        body.clear()
    conn.buffered = 0
    return data


async def iter_body(conn: Conn) -> AsyncIterator[bytes]:
    """Each read of a streamed reply's body as it comes (``b""``-free), to its end."""
    while True:
        data = take_body(conn)
        if data:
            yield data
        elif conn.complete:
            return
        else:
            await _more(conn)


async def first_body(conn: Conn) -> None:
    """Until a streamed reply's body has its first bytes (or the reply ended)."""
    while not conn.body and not conn.complete:
        await _more(conn)


async def gather_rest(conn: Conn, limit: int) -> None:
    """The rest of a streamed reply gathered in the protocol, as a whole reply is (no wake-up
    per read), until its end or ``limit`` body bytes in all (then ``conn.over``). What arrived
    stays in ``conn.body``, also when the connection fails (the error is raised)."""
    conn.whole = True
    conn.limit = limit
    if conn.buffered > limit:
        conn.over = True
        return
    if conn.paused and not conn.closed:
        conn.paused = False
        conn.transport.resume_reading()  # type: ignore[union-attr]
    while not (conn.complete or conn.over):
        await conn.wait()
