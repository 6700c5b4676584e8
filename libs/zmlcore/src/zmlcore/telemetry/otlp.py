"""OTLP push of the metrics a service serves on /metrics.

The metrics live in prometheus_client's registry (zmlcore.telemetry.metrics); this module reads that
registry every ``OTEL_METRIC_EXPORT_INTERVAL`` ms and hands the samples, as OpenTelemetry SDK
metric data, to the SDK's OTLP exporter (which owns the wire format, retries and endpoint
variables). The installed SDK has no MetricProducer hook for a foreign registry, so the only
thing done here is the sample mapping: counters -> cumulative monotonic sums, gauges (and
untyped) -> gauges, histograms -> cumulative explicit-bucket histograms with the same bounds.
Summaries, infos and state sets are not used by ZML and are skipped.

Configured only by the standard ``OTEL_*`` variables (see :func:`metrics_wanted`); off, nothing
is imported or started.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.registry import Collector

log = logging.getLogger("zml.otlpmetrics")

DEFAULT_INTERVAL_MS = 60000.0
DEFAULT_TIMEOUT_MS = 30000.0
FINAL_FLUSH_MS = 5000.0


def metrics_wanted(env: dict[str, str] | None = None) -> bool:
    """On like tracing (zmlcore.telemetry.setup.tracing_wanted): ``OTEL_METRICS_EXPORTER`` set (not
    ``none``), or an OTLP endpoint set (the spec's default exporter is otlp); never with
    ``OTEL_SDK_DISABLED=true``."""
    env = dict(os.environ) if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_METRICS_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))


def _ms(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        log.warning("%s=%r is not a number of milliseconds; using %s", name, raw, default)
        return default
    return value if value > 0 else default


def _labels(labels: dict[str, str], drop: str = "") -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def snapshot(registry: Collector = REGISTRY, now_ns: int | None = None, start_ns: int = 0) -> list[Any]:
    """The registry's current samples as OpenTelemetry SDK ``Metric`` objects."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Histogram,
        HistogramDataPoint,
        Metric,
        NumberDataPoint,
        Sum,
    )

    now = now_ns or time.time_ns()
    cumulative = AggregationTemporality.CUMULATIVE
    out: list[Any] = []
    for family in registry.collect():
        kind = family.type
        if kind == "counter":
            created = {_labels(s.labels): int(s.value * 1e9) for s in family.samples if s.name.endswith("_created")}
            points = [NumberDataPoint(attributes=dict(s.labels), start_time_unix_nano=created.get(_labels(s.labels), start_ns),
                                      time_unix_nano=now, value=s.value)
                      for s in family.samples if s.name.endswith("_total")]
            data: Any = Sum(data_points=points, aggregation_temporality=cumulative, is_monotonic=True)
        elif kind in ("gauge", "unknown", "untyped"):
            data = Gauge(data_points=[NumberDataPoint(attributes=dict(s.labels), start_time_unix_nano=0,
                                                      time_unix_nano=now, value=s.value) for s in family.samples])
        elif kind == "histogram":
            data = Histogram(data_points=_histogram_points(family.samples, now, start_ns, HistogramDataPoint),
                             aggregation_temporality=cumulative)
        else:
            continue
        if data.data_points:
            out.append(Metric(name=family.name, description=family.documentation, unit=family.unit or "", data=data))
    return out


def _histogram_points(samples: Iterable[Any], now: int, start_ns: int, point: Any) -> list[Any]:
    """Prometheus's cumulative ``le`` buckets per label set -> OTLP's per-bucket counts."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in samples:
        key = _labels(s.labels, "le")
        h = series.setdefault(key, {"buckets": [], "sum": 0.0, "count": 0, "start": start_ns})
        if s.name.endswith("_bucket"):
            h["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            h["sum"] = s.value
        elif s.name.endswith("_count"):
            h["count"] = int(s.value)
        elif s.name.endswith("_created"):
            h["start"] = int(s.value * 1e9)
    points = []
    for key, h in series.items():
        buckets = sorted(h["buckets"])
        bounds = [le for le, _ in buckets if not math.isinf(le)]
        counts, below = [], 0.0
        for _, cum in buckets:
            counts.append(int(cum - below))
            below = cum
        if not buckets or not math.isinf(buckets[-1][0]):
            counts.append(h["count"] - int(below))  # the +Inf bucket (always present in practice)
        # Prometheus keeps no min/max: None leaves them out of the OTLP message.
        points.append(point(attributes=dict(key), start_time_unix_nano=h["start"], time_unix_nano=now,
                            count=h["count"], sum=h["sum"], bucket_counts=counts, explicit_bounds=bounds,
                            min=None, max=None))
    return points


class OTLPMetricsPusher:
    """A daemon thread exporting :func:`snapshot` every interval; :meth:`close` exports once
    more (the final flush) and shuts the exporter down."""

    def __init__(self, exporter: Any, resource: Any, interval_s: float, registry: Collector = REGISTRY) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.exporter = exporter
        self.resource = resource
        self.interval_s = interval_s
        self.registry = registry
        self.scope = InstrumentationScope("zml")
        self.start_ns = time.time_ns()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one export at a time (the final flush vs. the thread)
        self._thread = threading.Thread(target=self._run, name="zml-otlp-metrics", daemon=True)
        self._thread.start()

    def export(self, timeout_ms: float | None = None) -> bool:
        from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData, ResourceMetrics, ScopeMetrics

        with self._lock:
            try:
                metrics = snapshot(self.registry, start_ns=self.start_ns)
                data = MetricsData(resource_metrics=[ResourceMetrics(
                    resource=self.resource, schema_url="",
                    scope_metrics=[ScopeMetrics(scope=self.scope, metrics=metrics, schema_url="")])])
                timeout = timeout_ms or _ms("OTEL_METRIC_EXPORT_TIMEOUT", DEFAULT_TIMEOUT_MS)
                ok = self.exporter.export(data, timeout_millis=timeout)
                return bool(ok == MetricExportResult.SUCCESS)
            except Exception:  # a bad collector or exporter must not kill the thread or the service
                log.exception("OTLP metrics export failed")
                return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.export()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        # Bounded: a supervisor waits ~10 s after SIGTERM, and an unreachable collector retries.
        self.export(timeout_ms=min(_ms("OTEL_METRIC_EXPORT_TIMEOUT", DEFAULT_TIMEOUT_MS), FINAL_FLUSH_MS))
        try:
            self.exporter.shutdown()
        except Exception:
            log.exception("OTLP metrics exporter shutdown failed")


def setup_otlp_metrics(service: str) -> OTLPMetricsPusher | None:
    """Start pushing when the OTEL_* variables ask for it (protocol from
    ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``/``OTEL_EXPORTER_OTLP_PROTOCOL``, endpoint and headers
    read by the exporter itself); None when off."""
    if not metrics_wanted():
        return None
    from opentelemetry.sdk.resources import Resource

    name = os.environ.get("OTEL_METRICS_EXPORTER", "otlp").strip().lower() or "otlp"
    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        exporter: Any = ConsoleMetricExporter()
    elif name == "otlp":
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")).strip()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

            exporter = GrpcExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter()
    else:
        log.warning("OTEL_METRICS_EXPORTER=%s is not supported (otlp, console, none); not exporting metrics", name)
        return None
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    interval = _ms("OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_INTERVAL_MS) / 1000.0
    return OTLPMetricsPusher(exporter, Resource.create(attrs), interval)
