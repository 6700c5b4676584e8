"""HTTP transports (through the gateway): a real sync one on ``httpx.Client`` and its async
twin on ``httpx.AsyncClient`` (with httpx-aiohttp's transport). httpx exceptions become ZML errors here and nowhere else."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator


import httpx

from zml._core import (
    ApiCall,
    InferCall,
    RawReply,
    SSEDecoder,
    StreamEvent,
    decode_error,
    lower_headers,
    routing_from_headers,
    trace_headers,
)
from zml._errors import BackendError, ConnectionError, TimeoutError, ZMLError
from zmlcore.reply.sse import SSELineTooLong, aiter_sse_lines, iter_sse_lines

__all__ = ["AsyncHTTPTransport", "AsyncHTTPStream", "SyncHTTPStream", "SyncHTTPTransport"]


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"accept": "application/json", "user-agent": "zml-python"}
    if api_key:
        h["authorization"] = f"Bearer {api_key}"
    return h


def _timeout(seconds: float) -> httpx.Timeout:
    return httpx.Timeout(seconds, connect=min(seconds, 5.0))


def _translate(exc: httpx.HTTPError, url: str) -> ZMLError:
    # A connect timeout means "unreachable" too (the aiohttp transport reports a refused
    # connection as ConnectTimeout).
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return TimeoutError(f"{url}: no reply in time ({type(exc).__name__}). Increase timeout or reduce prompt length.")
    if isinstance(exc, httpx.TransportError):
        return ConnectionError(
            f"cannot reach the ZML gateway at {url} ({type(exc).__name__}: {exc}). "
            "Is `zml up` running? Check --endpoint / ZML_ENDPOINT."
        )
    return ZMLError(f"{url}: {exc}")


def _api_request(client: httpx.Client | httpx.AsyncClient, call: ApiCall) -> httpx.Request:
    """A Batch API call as an httpx request: JSON, or a multipart upload of the file."""
    if call.upload is not None:
        name, content = call.upload
        return client.build_request(call.method, call.path, params=call.query, data=call.fields or {},
                                    files={"file": (name, content, "application/jsonl")})
    headers = {"content-type": "application/json", **trace_headers()} if call.body is not None else {}
    if call.raw:
        headers["accept"] = "application/octet-stream"
    return client.build_request(call.method, call.path, params=call.query, content=call.body, headers=headers)


def _reply(resp: httpx.Response) -> RawReply:
    return RawReply(status=resp.status_code, headers=lower_headers(resp.headers), body=resp.content)


class SyncHTTPTransport:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_connections: int) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=_headers(api_key),
            timeout=_timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def request(self, method: str, path: str, body: bytes | None = None, timeout_s: float | None = None,
                headers: dict[str, str] | None = None) -> RawReply:
        url = self.base_url + path
        try:
            resp = self._client.request(
                method, path, content=body, timeout=_timeout(timeout_s) if timeout_s else httpx.USE_CLIENT_DEFAULT,
                headers={"content-type": "application/json", **trace_headers(), **(headers or {})}
                if body is not None else None,
            )
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        return _reply(resp)

    def infer(self, call: InferCall) -> RawReply:
        return self.request("POST", call.http_path, call.encode(), call.timeout_s, call.http_headers())

    def api(self, call: ApiCall) -> RawReply:
        """A Batch API request (``client.batches`` / ``client.files``)."""
        url = self.base_url + call.path
        try:
            resp = self._client.send(_api_request(self._client, call))
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        return _reply(resp)

    def nodes(self) -> RawReply:
        return self.request("GET", "/v1/nodes")

    def models(self) -> RawReply:
        return self.request("GET", "/v1/models")

    def open_stream(self, call: InferCall) -> SyncHTTPStream:
        url = self.base_url + call.http_path
        req = self._client.build_request(
            "POST", call.http_path, content=call.encode(), timeout=_timeout(call.timeout_s),
            headers={"content-type": "application/json", "accept": "text/event-stream", **trace_headers(),
                     **call.http_headers()},
        )
        try:
            resp = self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        if resp.status_code >= 400:
            try:
                resp.read()
            except httpx.HTTPError as exc:
                raise _translate(exc, url) from exc
            finally:
                resp.close()
            raise decode_error(_reply(resp))
        return SyncHTTPStream(resp, url)

    def close(self) -> None:
        self._client.close()


class SyncHTTPStream:
    """Stream events of one SSE reply; ``close()`` drops the connection, which cancels the
    request on the node."""

    def __init__(self, resp: httpx.Response, url: str) -> None:
        self._resp = resp
        self._url = url
        self.headers = lower_headers(resp.headers)

    def __iter__(self) -> Iterator[StreamEvent]:
        yield StreamEvent("start", routing=routing_from_headers(self.headers))
        dec = SSEDecoder()
        try:
            # SSE lines end at CR/LF only: iter_lines() would also split at U+2028 & co.
            for line in iter_sse_lines(self._resp.iter_bytes()):
                ev = dec.feed(line.decode("utf-8", "replace"))
                if ev is None:
                    continue
                yield ev
                if ev.kind in ("end", "error"):
                    return
            ev = dec.feed("")
            if ev is not None:
                yield ev
                if ev.kind in ("end", "error"):
                    return
        except httpx.HTTPError as exc:
            raise _translate(exc, self._url) from exc
        except SSELineTooLong as exc:
            raise BackendError(f"{self._url}: {exc}") from exc
        yield StreamEvent("error", error=BackendError("the stream ended before [DONE]"))

    def close(self) -> None:
        self._resp.close()


class AsyncHTTPTransport:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_connections: int) -> None:
        self.base_url = base_url.rstrip("/")
        # httpx's API on aiohttp's transport: ~1/7 of the default transport's CPU per request,
        # which matters for `zml bench` and large batches on one core. Imported here: aiohttp
        # costs ~0.2 CPU-s to import, which the synchronous client (most `zml` commands) skips.
        from httpx_aiohttp import HttpxAiohttpClient

        self._client = HttpxAiohttpClient(
            base_url=self.base_url,
            headers=_headers(api_key),
            timeout=_timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def request(
        self, method: str, path: str, body: bytes | None = None, timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> RawReply:
        url = self.base_url + path
        try:
            resp = await self._client.request(
                method, path, content=body, timeout=_timeout(timeout_s) if timeout_s else httpx.USE_CLIENT_DEFAULT,
                headers={"content-type": "application/json", **trace_headers(), **(headers or {})}
                if body is not None else None,
            )
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        return _reply(resp)

    async def infer(self, call: InferCall) -> RawReply:
        return await self.request("POST", call.http_path, call.encode(), call.timeout_s, call.http_headers())

    async def api(self, call: ApiCall) -> RawReply:
        """A Batch API request (``client.batches`` / ``client.files``)."""
        url = self.base_url + call.path
        try:
            resp = await self._client.send(_api_request(self._client, call))
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        return _reply(resp)

    async def nodes(self) -> RawReply:
        return await self.request("GET", "/v1/nodes")

    async def models(self) -> RawReply:
        return await self.request("GET", "/v1/models")

    async def open_stream(self, call: InferCall) -> AsyncHTTPStream:
        url = self.base_url + call.http_path
        req = self._client.build_request(
            "POST", call.http_path, content=call.encode(), timeout=_timeout(call.timeout_s),
            headers={"content-type": "application/json", "accept": "text/event-stream", **trace_headers(),
                     **call.http_headers()},
        )
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _translate(exc, url) from exc
        if resp.status_code >= 400:
            try:
                await resp.aread()
            except httpx.HTTPError as exc:
                raise _translate(exc, url) from exc
            finally:
                await resp.aclose()
            raise decode_error(_reply(resp))
        return AsyncHTTPStream(resp, url)

    async def aclose(self) -> None:
        await self._client.aclose()


class AsyncHTTPStream:
    def __init__(self, resp: httpx.Response, url: str) -> None:
        self._resp = resp
        self._url = url
        self.headers = lower_headers(resp.headers)

    async def events(self) -> AsyncIterator[StreamEvent]:
        yield StreamEvent("start", routing=routing_from_headers(self.headers))
        dec = SSEDecoder()
        try:
            async for line in aiter_sse_lines(self._resp.aiter_bytes()):
                ev = dec.feed(line.decode("utf-8", "replace"))
                if ev is None:
                    continue
                yield ev
                if ev.kind in ("end", "error"):
                    return
        except httpx.HTTPError as exc:
            raise _translate(exc, self._url) from exc
        except SSELineTooLong as exc:
            raise BackendError(f"{self._url}: {exc}") from exc
        yield StreamEvent("error", error=BackendError("the stream ended before [DONE]"))

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._resp.aclose()


