"""What both reply paths (one whole reply, a stream) make of the routers' messages, pure: the
router's error relayed as an HTTP answer, the tokens a reply used, the errors the gateway
answers itself."""

from __future__ import annotations

import math
import re

import msgspec

from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.errors import NoHealthyNodesError, ZMLError, error_class
from zml_gateway.asgi import JSON, Headers, content_length

_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def total_tokens(data: bytes) -> int:
    """Tokens a reply used (the last total_tokens: the routing metadata's), for plan limits."""
    found = _TOTAL_TOKENS.findall(data[-4096:])
    return int(found[-1]) if found else 0


def error_answer(code: str, data: bytes, retry_after: str | None, limits: Headers) -> tuple[int, bytes, Headers]:
    """(status, body, headers) of a router's error reply (``Zml-Error-Code`` ``code``): its
    body as the router wrote it, never empty; Retry-After in whole seconds; ``x-should-retry:
    false`` (which OpenAI's clients obey) where asking again cannot help, though the status
    alone would make them retry."""
    cls = error_class(code)
    if not data:  # never an empty error body: say what the code means
        data = msgspec.json.encode(cls(f"{code} from the router").to_body())
    headers = [JSON, content_length(data), *limits]
    if retry_after is not None:  # HTTP wants whole seconds
        headers.append((b"retry-after", str(max(1, math.ceil(float(retry_after)))).encode()))
    if cls.retryable and not cls.worth_retrying(None if retry_after is None else float(retry_after)):
        headers.append((b"x-should-retry", b"false"))
    return cls.http_status, data, headers


def broker_lost() -> ZMLError:
    return ZMLConnectionError("the broker connection was lost while the request was in flight; retry",
                              retry_after=0.5)


def no_router() -> NoHealthyNodesError:
    return NoHealthyNodesError("no router is running (no responders on zml.gateway.infer)", retry_after=1.0)
