"""Logging and tracing set-up shared by every service.

Tracing is OpenTelemetry: spans are exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT``
is set, and cost nothing otherwise (the API's no-op tracer).
"""

from __future__ import annotations

import logging
import os
import sys

from opentelemetry import trace


def setup_logging(service: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("ZML_LOG_LEVEL", "INFO")).upper(),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # httpx logs every request at INFO: on the router's hot path that is pure overhead.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def setup_tracing(service: str) -> None:
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
