"""A plain OpenAI-compatible server (a hosted API or a proxy): OpenAI's error shape, 429 with
``rate_limit_exceeded`` when overloaded, no engine-specific routes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from zml_sim.faces.base import DEFAULT_RETRY_AFTER_S
from zml_sim.faces.base import Face
from zml_sim.faces.base import retry_headers
from zml_sim.nodeview import NodeView


class OpenAI(Face):
    name = "openai"
    owner = "system"
    prefill = "never"  # OpenAI's API answers a trailing assistant message with a new one

    def error_body(self, status: int, message: str, kind: str) -> Any:
        otype = {"bad_request": "invalid_request_error", "not_found": "invalid_request_error",
                 "overloaded": "requests"}.get(kind, "server_error")
        code = {"not_found": "model_not_found", "overloaded": "rate_limit_exceeded"}.get(kind)
        return {"error": {"message": message, "type": otype, "param": None, "code": code}}

    def overload(self, node: NodeView) -> web.Response:
        message = "The server is overloaded: too many requests waiting. Retry later."
        return self.error(429, message, "overloaded", retry_headers(node, DEFAULT_RETRY_AFTER_S))


FACE = OpenAI()
