"""A lean keep-alive HTTP/1.1 client for the router's calls to its nodes.

An ``asyncio.Protocol`` per connection with httptools' (llhttp) response parser, one pool with
a bound on open sockets, and two ways to read a reply: whole (one wake-up per call: the body
is gathered in the protocol, up to a bound) or streamed (headers, then each read as it comes,
with flow control). It does what the router needs of HTTP and nothing else: no redirects,
cookies, proxies or compression (``accept-encoding: identity``: replies are relayed as they
come). Measured against aiohttp in ``benches/node_client_cost.py`` (docs/benchmarks.md).

Every way the node's HTTP can go wrong (refused or reset connection, malformed status line or
framing, early close, headers over the bounds) raises :class:`NodeHTTPError`; a connection is
reused only after a reply read to its end, and a call abandoned half-way (cancelled, bound hit)
closes its connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

from zml_router.node.conn import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    Conn,
    NodeHTTPError,
    Stale,
    first_body,
    gather_rest,
    iter_body,
    more_body,
    read_body,
    take_body,
)

__all__ = ["MAX_HEADERS", "MAX_HEAD_BYTES", "Conn", "NodeHTTP", "NodeHTTPError", "first_body", "gather_rest",
           "iter_body", "more_body", "read_body", "take_body"]

#: An idle connection older than this is closed rather than reused (aiohttp's default too): the
#: node may have gone without a word.
KEEPALIVE_S = 15.0
#: How long a stream released after [DONE] waits for its body's end to keep the connection.
_LINGER_S = 2.0


_ssl_default: ssl.SSLContext | None = None


def _default_ssl() -> ssl.SSLContext:
    """The system's CAs, as aiohttp's default: built once (it reads the CA store)."""
    global _ssl_default
    if _ssl_default is None:
        _ssl_default = ssl.create_default_context()
    return _ssl_default


class _Target:
    """A node URL, parsed once: pool key, address, and the request's fixed head."""

    __slots__ = ("key", "host", "port", "ssl", "head")

    def __init__(self, url: str, ssl_ctx: ssl.SSLContext | None) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise NodeHTTPError(f"not an http(s) URL: {url!r}")
        tls = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if tls else 80)
        self.ssl = (ssl_ctx or _default_ssl()) if tls else None
        self.key = (u.scheme, self.host, self.port)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = self.port == (443 if tls else 80)
        self.head = (f"POST {path} HTTP/1.1\r\nhost: {host}{'' if default else f':{self.port}'}\r\n"
                     "accept-encoding: identity\r\n").encode()


class NodeHTTP:
    """Connections to the nodes: at most ``max_connections`` open (in use or idle, all nodes)."""

    def __init__(self, max_connections: int, connect_timeout: float, error_limit: int = 64 * 1024,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.max = max_connections
        self.connect_timeout = connect_timeout
        self.error_limit = error_limit
        self._ssl = ssl_context
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, str, int], list[Conn]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, _Target] = {}
        self._closing = False

    def target(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            if len(self._targets) > 4096:  # endpoints come and go with the fleet: bounded
                self._targets.clear()
                self._idle = {k: v for k, v in self._idle.items() if v}
            t = self._targets[url] = _Target(url, self._ssl)
        return t

    async def send(self, url: str, body: bytes, headers: dict[str, str], whole: bool, limit: int = 0) -> Conn:
        """POST; return the connection once the reply's head is in (``whole``: its body too, up
        to ``limit`` bytes for a 2xx, ``error_limit`` otherwise). A reused connection that the
        node had closed is retried once on a fresh one."""
        t = self.target(url)
        head = t.head + "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode() + \
            b"content-length: %d\r\n\r\n" % len(body)
        if head.count(b"\n") != len(headers) + 5 or head.count(b"\r") != len(headers) + 5:
            raise ValueError("CR or LF in a request header")
        fresh = False
        while True:
            conn = await self._acquire(t, fresh)
            conn._new_reply(whole, limit)
            try:
                conn.transport.write(head + body)  # type: ignore[union-attr]
                while not (conn.complete or conn.over) if whole else not conn.headers_done:
                    await conn.wait()
                return conn
            except Stale:
                self.release(conn)
                if fresh:
                    raise
                fresh = True
            except BaseException:
                self.release(conn)
                raise

    async def _acquire(self, t: _Target, fresh: bool) -> Conn:
        idle = self._idle.get(t.key)
        while idle and not fresh:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():  # type: ignore[union-attr]
                self.close(conn)
            elif self.loop.time() - conn.idle_since > KEEPALIVE_S:
                self.close(conn)  # older ones are below it
                for old in idle[:]:
                    self.close(old)
            else:
                conn.reused = True
                conn.in_use = True
                return conn
        while self._open >= self.max:
            if not self._close_an_idle():
                fut = self.loop.create_future()
                self._waiters.append(fut)
                try:
                    await fut
                except BaseException:
                    if fut.done() and not fut.cancelled():
                        self._wake_one()  # pass the turn on
                    else:
                        self._waiters.remove(fut)
                    raise
                idle = self._idle.get(t.key)
                if idle and not fresh:
                    return await self._acquire(t, fresh)
        if self._closing:
            raise NodeHTTPError("the client is closed")
        self._open += 1
        made: list[Conn] = []

        def factory() -> Conn:
            made.append(Conn(self, t.key))
            return made[-1]

        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    factory, t.host, t.port, ssl=t.ssl, server_hostname=t.host if t.ssl is not None else None)
        except BaseException as exc:
            if made:
                if made[0].transport is not None:
                    made[0].transport.abort()
                self.forget(made[0])
            else:
                self._open -= 1
                self._wake_one()
            if isinstance(exc, TimeoutError):
                raise NodeHTTPError(f"connect to {t.host}:{t.port} timed out after {self.connect_timeout} s") from None
            if isinstance(exc, OSError):  # ssl errors too
                raise NodeHTTPError(f"connect to {t.host}:{t.port}: {type(exc).__name__}: {exc}") from exc
            raise
        return conn

    def _close_an_idle(self) -> bool:
        for conns in self._idle.values():
            if conns:
                self.close(conns[0])  # the longest idle
                return True
        return False

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def release(self, conn: Conn, linger: bool = False) -> None:
        """The call is over: back to the pool when its reply was read to the end on a
        connection the node keeps open, else closed (never reused half-read). ``linger``: the
        caller read all it wanted (a stream's [DONE]); the end of the body, due any moment, is
        awaited off the call for a short while (bounded in time and bytes) to keep the connection."""
        if not conn.in_use:
            return
        conn.in_use = False
        if conn.error is None and not conn.closed and not conn.over and not self._closing:
            if conn.complete:
                if conn.keep_alive:
                    self.park(conn)
                    return
            elif linger and conn.headers_done and conn.framed:
                conn.lingering = True
                conn.body.clear()
                conn.buffered = 0
                if conn.paused:
                    conn.paused = False
                    conn.transport.resume_reading()  # type: ignore[union-attr]
                self.loop.call_later(_LINGER_S, self._linger_over, conn)
                return
        self.close(conn)

    def park(self, conn: Conn) -> None:
        if conn.closed or self._closing:
            self.close(conn)
            return
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()  # type: ignore[union-attr]
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    def _linger_over(self, conn: Conn) -> None:
        if conn.lingering:
            conn.lingering = False
            self.close(conn)

    def close(self, conn: Conn) -> None:
        if not conn.closed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.abort()
        self.forget(conn)

    def forget(self, conn: Conn) -> None:
        if conn.counted:
            conn.counted = False
            self._open -= 1
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_one()

    async def aclose(self) -> None:
        self._closing = True
        for conns in list(self._idle.values()):
            for conn in list(conns):
                self.close(conn)
        self._idle.clear()
