"""The router's spans (only when zmlcore.telemetry.tracing.ON).

One SERVER span per request, continuing the caller's ``traceparent`` (gateway, raw NATS, SDK);
each dispatch to a node a CLIENT child span ("attempt") whose context goes to the node as
``traceparent``, ended with the failure class when the attempt fails before the first token;
a span for the time spent in the saturation queue. Attributes follow OpenTelemetry's GenAI
conventions plus ``zml.*``; prompts and completions are never recorded.

The request path calls these through RouterMetrics' hooks, which run in the request's task:
the attempt span is attached to that task's context so the HTTP headers built for the node
carry it, and detached when the attempt ends.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from zmlcore.telemetry import tracing
from zmlcore.policy import Decision, RouteRequest

if TYPE_CHECKING:
    from zml_router.incoming import Incoming
    from zml_router.outcome import Outcome as _Outcome

M = TypeVar("M", bound="Incoming")

OPERATION = {"chat": "chat", "completion": "text_completion"}

_SERVER: ContextVar[Any] = ContextVar("zml_router_server_span", default=None)
_ATTEMPT: ContextVar[tuple[Any, Token[Any]] | None] = ContextVar("zml_router_attempt_span", default=None)


async def handle(router_id: str, msg: M, request: Callable[[M], Coroutine[Any, Any, None]]) -> None:
    """``request(msg)`` (one request's path) inside its server span, continuing the trace of
    the message's headers."""
    parent = tracing.extract(msg.headers)
    span = tracing.tracer().start_span("zml.route", context=parent, kind=SpanKind.SERVER,
                                       attributes={"zml.router_id": router_id})
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    _SERVER.set(span)
    try:
        await request(msg)
    finally:
        _end_attempt(None)
        otel_context.detach(token)
        span.end()


def decided(d: Decision, rr: RouteRequest) -> None:
    """A node was chosen: open the attempt span (a child of the server span)."""
    _end_attempt(None)
    server = _SERVER.get()
    if server is None:
        return
    candidates = [f"{e.family}: {e.nodes_checked} checked" + (f", rejected: {e.rejected_reason}" if e.rejected_reason else "")
                  for e in d.evaluated]
    attrs: dict[str, Any] = {
        "zml.policy": d.policy, "zml.family": d.family, "zml.node_id": d.node_id,
        "zml.queue_depth": d.queue_depth, "zml.estimated_ttft_s": round(d.estimated_ttft_s, 4),
        "zml.cached_tokens.estimated": d.cached_tokens, "zml.session": d.session,
        "zml.candidates": candidates, "gen_ai.request.model": rr.model, "gen_ai.request.max_tokens": rr.max_tokens,
    }
    tracing.set_attrs(server, attrs)
    span = tracing.tracer().start_span(f"zml.attempt {d.node_id}", kind=SpanKind.CLIENT, attributes=attrs)
    token = otel_context.attach(trace.set_span_in_context(span))
    _ATTEMPT.set((span, token))


def dispatching(headers: dict[str, str], decision_id: str) -> None:
    """The HTTP request to the node: it carries the attempt span as ``traceparent``."""
    held = _ATTEMPT.get()
    if held is not None:
        tracing.set_attrs(held[0], {"zml.decision_id": decision_id, "http.request.method": "POST"})
        server = _SERVER.get()
        if server is not None:
            tracing.set_attrs(server, {"zml.decision_id": decision_id})
    tracing.inject(headers)


@contextmanager
def prefill_leg(node_id: str, decode_node: str) -> Iterator[None]:
    """A split request's prefill leg: a CLIENT span of its own (a child of the attempt span),
    whose context goes to the prefill node; the server span names both legs."""
    server = _SERVER.get()
    if server is not None:
        tracing.set_attrs(server, {"zml.prefill_node": node_id, "zml.node_id": decode_node})
    span = tracing.tracer().start_span(f"zml.prefill {node_id}", kind=SpanKind.CLIENT,
                                       attributes={"zml.prefill_node": node_id, "zml.decode_node": decode_node})
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    except BaseException as exc:
        span.set_attribute("error.type", type(exc).__name__)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        otel_context.detach(token)
        span.end()


def prefill_failed(cause: str) -> None:
    """The prefill leg failed: the request is served whole on its decode node."""
    server = _SERVER.get()
    if server is not None:
        tracing.set_attrs(server, {"zml.prefill_failed": cause})


def failed(cause: str) -> None:
    """The attempt failed before the first token (it will be re-routed or given up)."""
    _end_attempt(cause)


def cached(estimated: int | None, reported: int) -> None:
    """The engine's report of its prefix cache for this request, beside the router's estimate."""
    server = _SERVER.get()
    if server is not None:
        tracing.set_attrs(server, {"zml.cached_tokens.reported": reported,
                                   "gen_ai.usage.cache_read.input_tokens": reported})


def usage(prompt_tokens: int | None, completion_tokens: int | None) -> None:
    server = _SERVER.get()
    if server is not None:
        tracing.set_attrs(server, {"gen_ai.usage.input_tokens": prompt_tokens,
                                   "gen_ai.usage.output_tokens": completion_tokens})


def finished(out: "_Outcome", request_id: str) -> None:
    server = _SERVER.get()
    _end_attempt(None if out.ok or out.queued else (out.error_code or "INTERNAL"))
    if server is None:
        return
    op = OPERATION.get(out.op, out.op)
    info = out.info
    if out.model:
        server.update_name(f"{op} {out.model}" if op else f"zml.route {out.model}")
    tracing.set_attrs(server, {
        "gen_ai.operation.name": op, "gen_ai.request.model": out.model,
        "gen_ai.response.model": out.model if out.ok else None,
        "zml.request_id": request_id, "zml.node_id": out.node_id, "zml.family": out.family,
        "zml.attempts": out.attempts, "zml.queued": out.queued or None,
        "zml.ttft_s": round(info.time_to_first_token, 4) if out.ok and info is not None and info.time_to_first_token is not None else None,
    })
    if not out.ok and not out.queued:
        server.set_attribute("error.type", out.error_code or "INTERNAL")
        server.set_status(Status(StatusCode.ERROR, out.error_code or "INTERNAL"))


def queue_waited(headers: dict[str, str], enqueued_at: float, now: float) -> None:
    """The time a request spent in the saturation queue, as a span of its own (a child of the
    span that queued it: its traceparent travelled in the queued message's headers)."""
    parent = tracing.extract(headers)
    span = tracing.tracer().start_span("zml.queue.wait", context=parent, kind=SpanKind.INTERNAL,
                                       start_time=int(enqueued_at * 1e9),
                                       attributes={"zml.queue_wait_s": round(max(0.0, now - enqueued_at), 4)})
    span.end(end_time=int(now * 1e9))


def _end_attempt(cause: str | None) -> None:
    held = _ATTEMPT.get()
    if held is None:
        return
    span, token = held
    _ATTEMPT.set(None)
    if cause is not None:
        span.set_attribute("zml.failure_class", cause)
        span.set_attribute("error.type", cause)
        span.set_status(Status(StatusCode.ERROR, cause))
    try:
        otel_context.detach(token)
    except Exception:  # detached in another context already: the span still ends
        pass
    span.end()
