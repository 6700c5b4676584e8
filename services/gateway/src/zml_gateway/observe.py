"""ASGI middleware around the gateway: GET /metrics, the /dashboard routes, and the HTTP
metrics of the inference routes (status and duration), so the gateway's own code is unchanged.

The only per-request work is a send wrapper on the two inference paths: it notes the status
of ``http.response.start``.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from zmlcore import subjects
from zmlcore.telemetry import tracing
from zmlcore.errors import MethodNotAllowedError, ZMLError
from zmlcore.telemetry.metrics import CONTENT_TYPE, exposition
from zml_gateway import metrics
from zml_gateway.asgi import Handler, Receive, Scope, Send, send_error
from zml_gateway.dashboard import Dashboard

_INFER = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
#: (route, status) label sets and (route,) ones, built once.
_LABELS = {(r, s): (r, str(s)) for r in _INFER.values() for s in range(100, 600)}
_ROUTE = {r: (r,) for r in _INFER.values()}


class _Watch:
    __slots__ = ("send", "status")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.status = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class Observed:
    def __init__(self, app: Handler, *, serve_metrics: bool = True, dashboard: Dashboard | None = None) -> None:
        self.app = app
        self.serve_metrics = serve_metrics
        self.dashboard = dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = _INFER.get(path)
        if route is not None and scope["method"] == "POST":
            t0 = time.perf_counter()
            watch = _Watch(send)
            try:
                if tracing.ON:
                    await self._traced(scope, receive, watch, path)
                else:
                    await self.app(scope, receive, watch)
            finally:
                metrics.REQUESTS.inc(_LABELS.get((route, watch.status)) or (route, "0"))
                metrics.DURATION.observe(_ROUTE[route], time.perf_counter() - t0)
            return
        if path == "/metrics" and self.serve_metrics:
            if scope["method"] != "GET":
                return await send_error(send, MethodNotAllowedError("/metrics takes GET"), allow="GET")
            body = exposition()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE.encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if self.dashboard is not None and path.startswith("/dashboard"):
            try:
                await self.dashboard.handle(scope, receive, send)
            except ZMLError as exc:
                await send_error(send, exc, allow="GET")
            return
        await self.app(scope, receive, send)

    async def _traced(self, scope: Scope, receive: Receive, watch: _Watch, path: str) -> None:
        """The request in a SERVER span that continues the caller's ``traceparent``."""
        parent = tracing.extract_asgi(scope["headers"])
        client = scope.get("client")
        with tracing.tracer().start_as_current_span(
                f"POST {path}", context=parent, kind=SpanKind.SERVER,
                attributes={"http.request.method": "POST", "url.path": path, "http.route": path,
                            "client.address": client[0] if client else ""}) as span:
            await self.app(scope, receive, watch)
            span.set_attribute("http.response.status_code", watch.status)
            if watch.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(watch.status))


def forward(headers: dict[str, str]) -> None:
    """The NATS request to the routers carries the gateway span's ``traceparent``."""
    span = trace.get_current_span()
    if span.is_recording():
        request_id = headers.get(subjects.H_REQUEST_ID)
        if request_id:
            span.set_attribute("zml.request_id", request_id)
    tracing.inject(headers)
