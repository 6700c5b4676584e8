"""Calls to accelerator nodes over HTTP, and what each failure means for routing.

httpx is used with the aiohttp transport: the same httpx API at ~1/7 of the default
transport's CPU per request (see docs/benchmarks.md). Outcomes are classified here, in one
place, so the router's retry loop only sees :class:`Attempt` results.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import httpx
import aiohttp
from httpx_aiohttp import AiohttpTransport

from zmlcore.errors import ReplyTooLargeError
from zmlcore.sse import SSELineTooLong, aiter_sse_lines, data_field


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


class NodeClient:
    """HTTP to the nodes: httpx Requests and Responses over the aiohttp transport, sent
    straight to the transport. The client layers above it (redirects, auth, cookie jar
    updates) cost ~20% of the router's CPU per request (py-spy, docs/benchmarks.md) and do
    nothing for calls to our own nodes."""

    def __init__(self, max_connections: int, connect_timeout: float) -> None:
        self._max = max_connections
        self._timeout = {"connect": connect_timeout, "read": None, "write": None, "pool": None}
        self._transport: AiohttpTransport | None = None
        self._urls: dict[str, httpx.URL] = {}

    def _get_transport(self) -> AiohttpTransport:
        # The aiohttp session must be created inside the running loop.
        if self._transport is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max, limit_per_host=0, ttl_dns_cache=300),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._transport = AiohttpTransport(client=session)
        return self._transport

    def url(self, url: str) -> httpx.URL:
        u = self._urls.get(url)
        if u is None:
            u = self._urls[url] = httpx.URL(url)
        return u

    async def send(self, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        request = httpx.Request("POST", self.url(url), content=body, headers=headers,
                                extensions={"timeout": self._timeout})
        return await self._get_transport().handle_async_request(request)

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def classify(resp: httpx.Response, body: bytes) -> AttemptError:
    status = resp.status_code
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
            if resp.status_code >= 300:
                raise classify(resp, await _head(resp, MAX_ERROR_BODY))
            content = await _head(resp, max_bytes + 1)
        finally:
            await resp.aclose()
    except httpx.HTTPError as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    if len(content) > max_bytes:
        raise ReplyTooLargeError(f"the node's reply is over {max_bytes} bytes ([nats] max_reply_bytes)")
    return content


async def _head(resp: httpx.Response, limit: int) -> bytes:
    """At most ``limit`` bytes of a body (the rest is not read)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.aiter_bytes():
        parts.append(chunk[: limit - size])
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)


async def stream_sse(client: NodeClient, url: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """Yield the payload of each SSE ``data:`` line up to (not including) ``[DONE]``."""
    try:
        resp = await client.send(url, body, headers)
    except httpx.HTTPError as exc:
        raise AttemptError(Failure.NETWORK, 0, f"{type(exc).__name__}: {exc}") from exc
    try:
        if resp.status_code >= 300:
            raise classify(resp, await _head(resp, MAX_ERROR_BODY))
        try:
            # Lines end at CR/LF only (zmlcore.sse): not at U+2028 & co. inside JSON strings.
            async for line in aiter_sse_lines(resp.aiter_bytes()):
                data = data_field(line)
                if data is None:
                    continue
                data = data.strip()
                if data == b"[DONE]":
                    return
                if data:
                    yield data
        except httpx.HTTPError as exc:
            raise AttemptError(Failure.NETWORK, 0, f"stream broken: {type(exc).__name__}: {exc}") from exc
        except SSELineTooLong as exc:
            raise AttemptError(Failure.SERVER, 200, f"stream broken: {exc}") from exc
        # The server closed the stream without [DONE]: treat as a broken stream.
        raise AttemptError(Failure.NETWORK, 0, "stream ended without [DONE]")
    finally:
        await resp.aclose()


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
