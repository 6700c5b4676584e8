"""Calls to accelerator nodes over HTTP, and what each failure means for routing.

The HTTP is zml_router.nodeclient: a keep-alive HTTP/1.1 client on an asyncio Protocol with
httptools' parser. Against aiohttp called directly (the previous client) it costs ~3-9x less
CPU per call in benches/node_client_cost.py (docs/benchmarks.md): a whole reply is one wake-up
of the caller, with no request/response objects, header multidicts or stream readers built
per call. Outcomes are classified here, in one place, so the router's retry loop only sees
:class:`Attempt` results.
"""

from __future__ import annotations

import asyncio
import enum
import ssl
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import msgspec

from zmlcore.errors import ReplyTooLargeError
from zml_router.nodeclient import NodeHTTP, NodeHTTPError, iter_body, read_body
from zmlcore.reply.sse import EventRelay, SSELineTooLong, aiter_sse_lines, data_field, event_payloads


class Failure(enum.Enum):
    NETWORK = "network"  # connect/read error, dropped connection: cooldown, retry elsewhere
    SERVER = "server"  # 5xx: cooldown, retry elsewhere
    OVERLOADED = "overloaded"  # vLLM 503 queue overflow, TGI 429: saturated, retry elsewhere
    SLOW = "slow"  # no first byte within the attempt's deadline: cooldown, retry elsewhere
    NO_MODEL = "no_model"  # 404 for the model: the node does not have it, retry elsewhere
    CLIENT = "client"  # other 4xx: the request is at fault; no retry, no cooldown


@dataclass(slots=True)
class AttemptError(Exception):
    failure: Failure
    status: int
    detail: str
    retry_after: float | None = None
    #: True when the caller had already received part of the answer (a stream broken after its
    #: first token): the request cannot fail over, but the node is at fault all the same.
    mid_stream: bool = False


_decode_any = msgspec.json.Decoder()

#: Errors of the call itself (connect, reset, early close, malformed HTTP): the node's fault.
_NETWORK_ERRORS = (NodeHTTPError, OSError)

#: What is read of a node's error body: enough for any engine's error JSON.
MAX_ERROR_BODY = 64 * 1024


class NodeClient:
    """HTTP/1.1 to the nodes (zml_router.nodeclient), created inside the running loop.

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


def _retry_after(headers: dict[str, str]) -> float | None:
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def classify(status: int, headers: dict[str, str], body: bytes) -> AttemptError:
    detail = body[:500].decode("utf-8", "replace")
    ra = _retry_after(headers)
    if status == 429 or status == 503:
        return AttemptError(Failure.OVERLOADED, status, detail, ra)
    if status >= 500:
        return AttemptError(Failure.SERVER, status, detail, ra)
    if status == 404:
        return AttemptError(Failure.NO_MODEL, status, detail, ra)
    return AttemptError(Failure.CLIENT, status, detail, ra)


# No read timeout here: the router bounds each request as a whole with asyncio.timeout().

async def post_json(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                    max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """POST and return the body of a 2xx answer; raise AttemptError otherwise. A node's reply
    is read up to ``max_bytes`` (what any requester accepts, ``[nats] max_reply_bytes``): past
    that, ReplyTooLargeError — the request asked for more than can be delivered, so no other
    node would do better. An error body is read up to MAX_ERROR_BODY."""
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
        return content
    finally:
        http.release(conn)  # back to the pool when read to the end, else closed


async def stream_sse(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                     relay: bool = False) -> AsyncIterator[bytes]:
    """Yield the payload of each SSE ``data:`` line up to (not including) ``[DONE]``; with
    ``relay``, blocks of whole framed events instead, as they came (zmlcore.reply.sse.EventRelay):
    one per read from the node, however many events it held."""
    http = client.http()
    try:
        conn = await http.send(url, body, headers, False)
    except _NETWORK_ERRORS as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    done = False
    try:
        if conn.status >= 300:
            try:
                raise classify(conn.status, conn.headers, await read_body(conn, MAX_ERROR_BODY))
            except _NETWORK_ERRORS as exc:
                raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
        try:
            if relay:
                events = EventRelay()
                async for raw in iter_body(conn):
                    block = events.feed(raw)
                    if block:
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
                        yield data
        except _NETWORK_ERRORS as exc:
            raise AttemptError(Failure.NETWORK, 0, f"stream broken: {type(exc).__name__}: {exc}") from exc
        except SSELineTooLong as exc:
            raise AttemptError(Failure.SERVER, 200, f"stream broken: {exc}") from exc
        # The server closed the stream without [DONE]: treat as a broken stream.
        raise AttemptError(Failure.NETWORK, 0, "stream ended without [DONE]")
    finally:
        http.release(conn, linger=done)


def stream_usage(chunk: bytes) -> dict | None:  # type: ignore[type-arg]
    """The ``usage`` object of a stream chunk (one payload, or a relayed block of events)."""
    if b'"usage"' not in chunk:
        return None
    for payload in event_payloads(chunk) if chunk.startswith(b"data:") else (chunk,):
        if b'"usage"' not in payload:
            continue
        try:
            usage = _decode_any.decode(payload).get("usage")
        except (msgspec.DecodeError, AttributeError):
            continue
        if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
            return usage
    return None


async def within_first_byte(call: Awaitable[bytes], seconds: float | None) -> bytes:
    """``call`` (a whole non-streamed reply) or AttemptError(SLOW) after ``seconds``."""
    if seconds is None:
        return await call
    try:
        async with asyncio.timeout(seconds):
            return await call
    except TimeoutError:  # ours only: the request's own deadline arrives as a cancellation
        raise AttemptError(Failure.SLOW, 0, f"no reply within the first-byte deadline of {seconds:.1f} s") from None


async def first_chunk_within(chunks: AsyncIterator[bytes], seconds: float | None) -> AsyncIterator[bytes]:
    """The chunks of ``chunks``, the first one due within ``seconds`` (AttemptError SLOW)."""
    try:
        if seconds is not None:
            try:
                async with asyncio.timeout(seconds):
                    first = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise AttemptError(Failure.SLOW, 0, f"no first token within {seconds:.1f} s") from None
            yield first
        async for chunk in chunks:
            yield chunk
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
