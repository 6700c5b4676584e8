"""OpenTelemetry on ZML's request path: W3C trace context in HTTP and NATS headers, and the
span helpers the gateway and router use.

Turned on by :func:`zmlcore.telemetry.setup.setup_tracing` (the ``OTEL_*`` variables). Every hook on
the request path first tests :data:`ON`, so with tracing off a request pays one attribute read
per hook and nothing else. Prompts and completions are never put on a span.

    from zmlcore.telemetry import tracing
    if tracing.ON:
        tracing.inject(nats_headers)         # traceparent of the current span
    ctx = tracing.extract(msg.headers)        # a caller's traceparent, continued
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

#: True once an exporting TracerProvider is installed (or a test installed one).
ON = False

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None


def enable(on: bool = True) -> None:
    global ON, _tracer
    ON = on
    _tracer = None


def tracer() -> trace.Tracer:
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer("zml")
    return _tracer


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The caller's context from ``traceparent``/``tracestate`` (NATS or lower-cased HTTP
    headers); None when there is none (the span then starts a trace)."""
    if not headers or TRACEPARENT not in headers:
        return None
    return _propagator.extract(headers)


def extract_asgi(raw: Iterable[tuple[bytes, bytes]]) -> Context | None:
    carrier: dict[str, str] = {}
    for name, value in raw:
        if name == b"traceparent" or name == b"tracestate":
            carrier[name.decode()] = value.decode("latin-1")[:512]
    return extract(carrier)


def inject(headers: dict[str, str], ctx: Context | None = None) -> None:
    """Add the current (or ``ctx``'s) span as ``traceparent`` (+ ``tracestate``)."""
    _propagator.inject(headers, context=ctx)


def set_attrs(span: Any, attrs: Mapping[str, Any]) -> None:
    """Set the attributes that have a value (OpenTelemetry refuses None)."""
    if span.is_recording():
        span.set_attributes({k: v for k, v in attrs.items() if v is not None and v != ""})
