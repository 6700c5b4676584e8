"""The ASGI shapes the gateway speaks (raw ASGI 3, no framework) and the answers every part
of it writes alike: a whole JSON body, and a ZMLError as OpenAI's error body.

Every module of the gateway that talks ASGI imports its types from here, and nothing else
of the gateway: the app, its routes, the dashboard and the metrics middleware stand on it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from zmlcore.errors import ZMLError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
#: Response headers as ASGI carries them.
Headers = list[tuple[bytes, bytes]]

JSON = (b"content-type", b"application/json")

_encode = msgspec.json.encode


def content_length(body: bytes) -> tuple[bytes, bytes]:
    """A whole reply's length: the client reads no chunked framing, and the server writes head
    and body at once (zml_gateway.protocol.FastCycle)."""
    return (b"content-length", b"%d" % len(body))


async def send_whole(send: Send, status: int, body: bytes, headers: Headers) -> None:
    """A complete answer, ``headers`` first (its JSON content type and length included)."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any, extra: Headers | None = None) -> None:
    body = _encode(payload)
    await send_whole(send, status, body, [JSON, content_length(body), *(extra or ())])


async def send_error(send: Send, exc: ZMLError, allow: str | None = None) -> None:
    """``exc`` as OpenAI's error body with its HTTP status; ``allow``: the methods a 405's path takes."""
    extra = []
    if exc.http_status == 405 and allow is not None:
        extra.append((b"allow", allow.encode()))
    if exc.retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    if exc.retryable and not exc.worth_retrying(exc.retry_after):  # (OpenAI's clients obey it)
        extra.append((b"x-should-retry", b"false"))
    if exc.http_status == 408:  # a body cut off: its rest would be read as a next request
        extra.append((b"connection", b"close"))
    await send_json(send, exc.http_status, exc.to_body(), extra)


def without_body(send: Send) -> Send:
    """``send`` for a HEAD request: the response's head as for GET, its body bytes dropped."""
    async def head_only(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            message = {**message, "body": b""}
        await send(message)
    return head_only
