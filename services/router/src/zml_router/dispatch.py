"""Calls to accelerator nodes over HTTP, and what each failure means for routing.

aiohttp is called directly: one ``ClientSession`` (no cookie jar), node URLs parsed once, the
body read with a bound. Measured against httpx's API over the same aiohttp transport (the
design card's choice) it costs ~45% less CPU per call (docs/benchmarks.md): httpx's
``Request``/``Response``/``Headers`` objects, built and unwrapped on every call, did nothing
for calls to our own nodes. Outcomes are classified here, in one place, so the router's retry
loop only sees :class:`Attempt` results.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import aiohttp
import msgspec
from yarl import URL

from zmlcore.errors import ReplyTooLargeError
from zmlcore.sse import EventRelay, SSELineTooLong, aiter_sse_lines, data_field, event_payloads


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

#: Errors of the call itself (connect, reset, timeout of the connect, malformed HTTP): the node's fault.
_NETWORK_ERRORS = (aiohttp.ClientError, OSError)


class NodeClient:
    """HTTP/1.1 to the nodes: one aiohttp session, created inside the running loop.

    Only the connect is timed here (``connect_timeout``); waiting for a free connection and
    reading are bounded by the request's own deadline (the router's ``asyncio.timeout``)."""

    def __init__(self, max_connections: int, connect_timeout: float) -> None:
        self._max = max_connections
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout, sock_read=None)
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max, limit_per_host=0, ttl_dns_cache=300),
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=self._timeout,
                # Replies are relayed as they come: ask for them uncompressed.
                headers={"accept-encoding": "identity"},
            )
        return self._session

    def url(self, url: str) -> URL:
        u = self._urls.get(url)
        if u is None:
            if len(self._urls) > 4096:  # endpoints come and go with the fleet: bounded
                self._urls.clear()
            u = self._urls[url] = URL(url)
        return u

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        return await self._get_session().request("POST", self.url(url), data=body, headers=headers,
                                                 allow_redirects=False)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def classify(resp: aiohttp.ClientResponse, body: bytes) -> AttemptError:
    status = resp.status
    detail = body[:500].decode("utf-8", "replace")
    ra = _retry_after(resp)
    if status == 429 or status == 503:
        return AttemptError(Failure.OVERLOADED, status, detail, ra)
    if status >= 500:
        return AttemptError(Failure.SERVER, status, detail, ra)
    if status == 404:
        return AttemptError(Failure.NO_MODEL, status, detail, ra)
    return AttemptError(Failure.CLIENT, status, detail, ra)


#: What is read of a node's error body: enough for any engine's error JSON.
MAX_ERROR_BODY = 64 * 1024


# No read timeout here: the router bounds each request as a whole with asyncio.timeout().

async def post_json(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                    max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """POST and return the body of a 2xx answer; raise AttemptError otherwise. A node's reply
    is read up to ``max_bytes`` (what any requester accepts, ``[nats] max_reply_bytes``): past
    that, ReplyTooLargeError — the request asked for more than can be delivered, so no other
    node would do better."""
    try:
        resp = await client.send(url, body, headers)
        try:
            if resp.status >= 300:
                raise classify(resp, await _head(resp, MAX_ERROR_BODY))
            content = await _head(resp, max_bytes + 1)
        finally:
            resp.release()  # back to the pool when read to the end, else the connection is closed
    except _NETWORK_ERRORS as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    if len(content) > max_bytes:
        raise ReplyTooLargeError(f"the node's reply is over {max_bytes} bytes ([nats] max_reply_bytes)")
    return content


async def _head(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """At most ``limit`` bytes of a body (the rest is not read)."""
    length = resp.content_length
    if length is not None and length < limit:  # the usual reply: one read, bounded by its length
        return await resp.content.read()
    parts: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await resp.content.readany()
        if not chunk:
            break
        parts.append(chunk[: limit - size])
        size += len(chunk)
    return b"".join(parts)


async def stream_sse(client: NodeClient, url: str, body: bytes, headers: dict[str, str],
                     relay: bool = False) -> AsyncIterator[bytes]:
    """Yield the payload of each SSE ``data:`` line up to (not including) ``[DONE]``; with
    ``relay``, blocks of whole framed events instead, as they came (zmlcore.sse.EventRelay):
    one per read from the node, however many events it held."""
    try:
        resp = await client.send(url, body, headers)
    except _NETWORK_ERRORS as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    try:
        if resp.status >= 300:
            try:
                raise classify(resp, await _head(resp, MAX_ERROR_BODY))
            except _NETWORK_ERRORS as exc:
                raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
        try:
            if relay:
                events = EventRelay()
                async for raw in resp.content.iter_any():
                    block = events.feed(raw)
                    if block:
                        yield block
                    if events.done:
                        return
            else:
                # Lines end at CR/LF only (zmlcore.sse): not at U+2028 & co. inside JSON strings.
                async for line in aiter_sse_lines(resp.content.iter_any()):
                    data = data_field(line)
                    if data is None:
                        continue
                    data = data.strip()
                    if data == b"[DONE]":
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
        resp.release()


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
