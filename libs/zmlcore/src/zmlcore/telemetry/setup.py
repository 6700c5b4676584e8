"""Logging and tracing set-up shared by every service.

Logs: text by default; ``--log-format json`` (or ZML_LOG_FORMAT=json) writes one JSON object
per line. A line logged while a request is handled carries its ``request_id``, ``decision_id``
and ``trace_id`` (context variables set on the request path, so every task of a request has
them and no call site passes them along). Request bodies are never logged.

Tracing is OpenTelemetry, configured only by the standard ``OTEL_*`` variables: it is on when
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_TRACES_EXPORTER`` (otlp, console) is set and ``OTEL_SDK_DISABLED`` is not true; the
sampler comes from ``OTEL_TRACES_SAMPLER``/``_ARG``, the protocol from
``OTEL_EXPORTER_OTLP_PROTOCOL`` (http/protobuf or grpc). Off, the request path only tests a
module flag (zmlcore.telemetry.tracing).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextvars import ContextVar

import msgspec
from opentelemetry import trace

#: Set on the request path; read by the JSON formatter.
REQUEST_ID: ContextVar[str] = ContextVar("zml_request_id", default="")
DECISION_ID: ContextVar[str] = ContextVar("zml_decision_id", default="")

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, logger, msg, request/decision/trace ids,
    and any ``extra={...}`` fields a call site passes."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service
        self._encode = msgspec.json.Encoder(enc_hook=str).encode

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = REQUEST_ID.get()
        if rid:
            out["request_id"] = rid
        did = DECISION_ID.get()
        if did:
            out["decision_id"] = did
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
            out["span_id"] = format(ctx.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _STD_ATTRS and key not in out and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return self._encode(out).decode()


def setup_logging(service: str, level: str | None = None, fmt: str | None = None) -> None:
    fmt = fmt or os.environ.get("ZML_LOG_FORMAT", "text")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(f"zml-{service}"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=(level or os.environ.get("ZML_LOG_LEVEL", "INFO")).upper(), handlers=[handler],
                        force=True)
    # httpx logs every request at INFO: on the router's hot path that is pure overhead.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def tracing_wanted(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ) if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service: str) -> bool:
    """Install an exporting TracerProvider when the OTEL_* variables ask for one; True if so."""
    if not tracing_wanted():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        if protocol.strip() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            exporter = GrpcExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    from zmlcore.telemetry import tracing

    tracing.enable()
    return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)
