"""Calls to accelerator nodes over HTTP: a whole reply, or a stream of SSE payloads.

The HTTP is zml_router.node.client: a keep-alive HTTP/1.1 client on an asyncio Protocol with
httptools' parser. Against aiohttp called directly (the previous client) it costs ~3-9x less
CPU per call in benches/node_client_cost.py (docs/benchmarks.md): a whole reply is one wake-up
of the caller, with no request/response objects, header multidicts or stream readers built
per call. Every way a call fails is raised here as an :class:`~zml_router.node.attempt.AttemptError`
(classified in ``zml_router.node.attempt``), so the router's retry loop sees nothing else.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncGenerator, Callable

from zmlcore.errors import ReplyTooLargeError
from zmlcore.reply.sse import EventRelay, SSELineTooLong, aiter_sse_lines, data_field

from zml_router.node.attempt import AttemptError, Failure, classify
from zml_router.node.client import (Conn, NodeHTTP, NodeHTTPError, first_body, gather_rest, iter_body, more_body,
                                    read_body, take_body)
from zml_router.timers import Stalled, Wheel

#: Errors of the call itself (connect, reset, early close, malformed HTTP): the node's fault.
_NETWORK_ERRORS = (NodeHTTPError, OSError)

#: What is read of a node's error body: enough for any engine's error JSON.
MAX_ERROR_BODY = 64 * 1024
#: OpenAI's streamed transcriptions end with this event (and no ``[DONE]``): a stream whose body
#: ends right after it ended well.
TRANSCRIPT_DONE = b'"transcript.text.done"'


class NodeClient:
    """HTTP/1.1 to the nodes (zml_router.node.client), created inside the running loop.

    Only the connect is timed here (``connect_timeout``); waiting for a free connection and
    reading are bounded by the request's own deadline (the router's ``asyncio.timeout``)."""

    def __init__(self, max_connections: int, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._max = max_connections
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._http: NodeHTTP | None = None

    def http(self) -> NodeHTTP:
        if self._http is None:
            self._http = NodeHTTP(self._max, self._connect_timeout, MAX_ERROR_BODY, self._ssl)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()


# No read timeout here: the router bounds each request as a whole with asyncio.timeout().

async def post_json(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                    max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """POST and return the body of a 2xx answer; raise AttemptError otherwise. A node's reply
    is read up to ``max_bytes`` (what any requester accepts, ``[nats] max_reply_bytes``): past
    that, ReplyTooLargeError — the request asked for more than can be delivered, so no other
    node would do better. An error body is read up to MAX_ERROR_BODY."""
    return (await post(client, url, body, headers, max_bytes))[0]


async def post(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
               max_bytes: int = 64 * 1024 * 1024) -> tuple[bytes, str]:
    """:func:`post_json`, and the answer's content type (audio answers text, SRT, VTT...)."""
    http = client.http()
    try:
        conn = await http.send(url, body, headers, True, max_bytes)
    except _NETWORK_ERRORS as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    try:
        content = conn.body[0] if len(conn.body) == 1 else b"".join(conn.body)
        if conn.status >= 300:
            raise classify(conn.status, conn.headers, content)
        if conn.over:
            raise ReplyTooLargeError(f"the node's reply is over {max_bytes} bytes ([nats] max_reply_bytes)")
        return content, conn.headers.get("content-type", "application/json")
    finally:
        http.release(conn)  # back to the pool when read to the end, else closed


async def post_streamed(client: NodeClient, url: str, body: bytes, headers: dict[str, str], *, timers: Wheel,
                        first_byte: float | None, stall_s: float | Callable[[], float], max_bytes: int,
                        first: Callable[[bool], None], feed: Callable[[bytes], None],
                        stay: Callable[[], bool] | None = None) -> bool:
    """POST a non-streamed request asked of the node as a stream (``zml_router.answer.assemble``):
    ``first(complete)`` once the body's first bytes are in (the first token, due within
    ``first_byte`` seconds unless ``stay()`` says wait on; ``complete``: the whole body is in already, as a fast node's often
    is), then the rest gathered in the protocol with one wake-up at its end (a stall of
    ``stall_s`` with no byte is a SLOW failure; a callable is asked only then: a fast node's
    whole body is often in with its first byte, and then no deadline is needed), all of it
    handed to ``feed``. What arrived is fed on a failure too (before the AttemptError), so
    the answer so far can be continued.
    False when the node answered a plain JSON reply instead of a stream (fed whole)."""
    http = client.http()
    conn: Conn | None = None
    try:
        try:
            # The head and the first token are both due within first_byte: a node that takes
            # the request and sends nothing at all is left as one that sends only its head.
            with timers.deadline(first_byte, stay) if first_byte is not None else contextlib.nullcontext():
                try:
                    conn = await http.send(url, body, headers, False)
                except _NETWORK_ERRORS as exc:
                    raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
                if conn.status < 300 and not (conn.body or conn.complete):
                    try:
                        await first_body(conn)
                    except _NETWORK_ERRORS as exc:
                        raise AttemptError(Failure.NETWORK, 0,
                                           f"stream broken: {type(exc).__name__}: {exc}") from exc
        except TimeoutError:  # ours only: the request's own deadline arrives as a cancellation
            raise AttemptError(Failure.SLOW, 0, f"no first token within {first_byte:.1f} s") from None
        if conn.status >= 300:
            try:
                raise classify(conn.status, conn.headers, await read_body(conn, MAX_ERROR_BODY))
            except _NETWORK_ERRORS as exc:
                raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
        sse = "text/event-stream" in conn.headers.get("content-type", "")
        try:
            first(conn.complete)
            if not conn.complete:  # (a fast node's whole stream is often in already)
                c = conn
                stall = stall_s() if callable(stall_s) else stall_s
                try:
                    with timers.watch(stall, lambda: c.buffered):
                        await gather_rest(c, max_bytes)
                except Stalled:
                    raise AttemptError(Failure.SLOW, 0, f"no token for {stall:.2g} s (the node's inter-token "
                                       "deadline: [router] inter_token_*)") from None
            elif conn.buffered > max_bytes:
                conn.over = True
        except _NETWORK_ERRORS as exc:
            raise AttemptError(Failure.NETWORK, 0, f"stream broken: {type(exc).__name__}: {exc}") from exc
        finally:
            if conn.body:
                data = conn.body[0] if len(conn.body) == 1 else b"".join(conn.body)
                conn.body.clear()
                feed(data)
        if conn.over:
            raise ReplyTooLargeError(f"the node's reply is over {max_bytes} bytes ([nats] max_reply_bytes)")
        return sse
    finally:
        if conn is not None:
            http.release(conn)


async def stream_sse(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                     relay: bool = False) -> AsyncGenerator[bytes, None]:
    """Yield the payload of each SSE ``data:`` line up to (not including) ``[DONE]``; with
    ``relay``, blocks of whole framed events instead, as they came (zmlcore.reply.sse.EventRelay):
    one per read from the node, however many events it held."""
    http = client.http()
    try:
        conn = await http.send(url, body, headers, False)
    except _NETWORK_ERRORS as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    done = False
    final = False  # the last event was a transcription's end (OpenAI's streams end there)
    try:
        if conn.status >= 300:
            try:
                raise classify(conn.status, conn.headers, await read_body(conn, MAX_ERROR_BODY))
            except _NETWORK_ERRORS as exc:
                raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
        try:
            if relay:
                events = EventRelay()
                while True:  # (iter_body's loop, inline: no async generator of its own per stream)
                    raw = take_body(conn)
                    if not raw:
                        if conn.complete:
                            break
                        await more_body(conn)
                        continue
                    block = events.feed(raw)
                    if block:
                        final = TRANSCRIPT_DONE in block
                        yield block
                    if events.done:
                        done = True
                        return
            else:
                # Lines end at CR/LF only (zmlcore.reply.sse): not at U+2028 & co. inside JSON strings.
                async for line in aiter_sse_lines(iter_body(conn)):
                    data = data_field(line)
                    if data is None:
                        continue
                    data = data.strip()
                    if data == b"[DONE]":
                        done = True
                        return
                    if data:
                        final = TRANSCRIPT_DONE in data
                        yield data
        except _NETWORK_ERRORS as exc:
            raise AttemptError(Failure.NETWORK, 0, f"stream broken: {type(exc).__name__}: {exc}") from exc
        except SSELineTooLong as exc:
            raise AttemptError(Failure.SERVER, 200, f"stream broken: {exc}") from exc
        if final:  # a transcription's last event, then the end of the body: complete
            done = True
            return
        # The server closed the stream without [DONE]: treat as a broken stream.
        raise AttemptError(Failure.NETWORK, 0, "stream ended without [DONE]")
    finally:
        http.release(conn, linger=done)
