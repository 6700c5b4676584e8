"""zmlcore.telemetry.otlp: when OTLP metrics push is on, and the prometheus_client -> OTLP mapping."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from zmlcore.telemetry.otlp import metrics_wanted, snapshot


def test_on_only_when_the_otel_variables_ask() -> None:
    assert not metrics_wanted({})
    assert metrics_wanted({"OTEL_METRICS_EXPORTER": "otlp"})
    assert metrics_wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert metrics_wanted({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://127.0.0.1:4318/v1/metrics"})
    assert not metrics_wanted({"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert not metrics_wanted({"OTEL_SDK_DISABLED": "true", "OTEL_METRICS_EXPORTER": "otlp"})
    assert not metrics_wanted({"OTEL_TRACES_EXPORTER": "otlp"})  # traces alone do not turn metrics on


def test_counters_gauges_and_histograms_map_to_their_otlp_kinds() -> None:
    reg = CollectorRegistry()
    Counter("t_requests", "reqs", ["code"], registry=reg).labels("OK").inc(3)
    Gauge("t_depth", "depth", registry=reg).set(7)
    h = Histogram("t_seconds", "dur", ["m"], buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.5, 0.7, 5.0):
        h.labels("a").observe(v)
    got = {m.name: m for m in snapshot(reg)}
    assert set(got) == {"t_requests", "t_depth", "t_seconds"}
    s = got["t_requests"].data
    assert s.is_monotonic and s.aggregation_temporality.name == "CUMULATIVE"
    assert [(dict(p.attributes), p.value) for p in s.data_points] == [({"code": "OK"}, 3.0)]
    assert s.data_points[0].start_time_unix_nano > 0  # from the counter's _created sample
    assert [p.value for p in got["t_depth"].data.data_points] == [7.0]
    (p,) = got["t_seconds"].data.data_points
    assert dict(p.attributes) == {"m": "a"}  # no "le"
    assert list(p.explicit_bounds) == [0.1, 1.0] and list(p.bucket_counts) == [1, 2, 1]
    assert p.count == 4 and abs(p.sum - 6.25) < 1e-9
