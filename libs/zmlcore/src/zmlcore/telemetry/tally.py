"""Counters and histograms bumped per request as plain numbers, folded into Prometheus families
when ``/metrics`` is scraped.

prometheus_client's ``Counter.inc`` / ``Histogram.observe`` take a lock, check observability and
walk the buckets in Python on every call: ~1.5 us each, and a request of the router makes six
of them. Here a count is ``list[0] += 1`` and an observation one ``bisect`` plus two additions
on a per-label-set list; the exposition (names, ``_total``, ``_bucket``/``_count``/``_sum``,
``_created``) is built at scrape time and is the same as prometheus_client's own.

    REQUESTS = CounterTally("zml_x_requests", "...", ["model", "code"])
    LATENCY = HistogramTally("zml_x_seconds", "...", ["model"], buckets=(0.01, 0.1, 1.0))
    TALLIES = Tallies(REQUESTS, LATENCY)   # register(TALLIES) once per process
    REQUESTS.inc(("llama", "OK"))
    LATENCY.observe(("llama",), 0.05)

Thread safety: only the event loop writes; a scrape (another thread) copies each series with
one C-level ``list(...)`` under the GIL, so it never sees a half-updated dict. A histogram's
``_count`` is the sum of the copied buckets (always consistent with them); its ``_sum`` may be
one observation behind, as with any scrape racing an observation.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from zmlcore.telemetry import metrics as _metrics

Labels = tuple[str, ...]


class _Series:
    """Label sets of one metric, bounded like :class:`zmlcore.telemetry.metrics.Children`: past
    MAX_CHILDREN, new label sets share the values "other"."""

    __slots__ = ("name", "doc", "labelnames", "_series", "_created")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = list(labelnames)
        self._series: dict[Labels, list[float]] = {}
        self._created: dict[Labels, float] = {}

    def _add(self, labels: Labels, width: int) -> list[float]:
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {labels!r}")
        if len(self._series) >= _metrics.MAX_CHILDREN:
            labels = tuple("other" for _ in labels)
            have = self._series.get(labels)
            if have is not None:
                return have
        values = [0.0] * width
        self._created[labels] = time.time()
        self._series[labels] = values
        return values

    def _items(self) -> list[tuple[Labels, list[float], float]]:
        created = self._created
        return [(k, list(v), created.get(k, 0.0)) for k, v in list(self._series.items())]

    def value(self, labels: Labels) -> list[float] | None:
        """A copy of one label set's numbers (tests, debugging)."""
        v = self._series.get(labels)
        return None if v is None else list(v)


class CounterTally(_Series):
    """A monotonic counter per label set, exposed as ``<name>_total`` (and ``_created``)."""

    __slots__ = ()

    def inc(self, labels: Labels, amount: float = 1) -> None:
        v = self._series.get(labels)
        if v is None:
            v = self._add(labels, 1)
        v[0] += amount

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, v, created in self._items():
            fam.add_metric(labels, v[0], created=created)
        return fam


class HistogramTally(_Series):
    """A histogram per label set: one count per bucket (the last one +Inf) and the sum."""

    __slots__ = ("bounds", "_les")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, doc, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if bounds and bounds[-1] == float("inf"):
            bounds.pop()
        self.bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def observe(self, labels: Labels, value: float) -> None:
        v = self._series.get(labels)
        if v is None:
            v = self._add(labels, len(self.bounds) + 2)  # buckets, +Inf, sum
        v[bisect_left(self.bounds, value)] += 1  # the first bucket with le >= value
        v[-1] += value

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        created_samples = []
        for labels, v, created in self._items():
            total, cumulative = 0.0, []
            for le, n in zip(self._les, v[:-1]):
                total += n
                cumulative.append((le, total))
            fam.add_metric(list(labels), cumulative, v[-1])
            created_samples.append(Sample(self.name + "_created", dict(zip(self.labelnames, labels)), created))
        fam.samples.extend(created_samples)
        return fam


class Tallies(Collector):
    """The collector of a set of tallies (register it once per process)."""

    def __init__(self, *tallies: CounterTally | HistogramTally) -> None:
        self.tallies = tallies

    def collect(self) -> Iterator[Metric]:
        for t in self.tallies:
            yield t.family()

    def describe(self) -> Iterator[Metric]:
        for t in self.tallies:  # the names, for the registry's duplicate check
            yield (CounterMetricFamily if isinstance(t, CounterTally) else HistogramMetricFamily)(
                t.name, t.doc, labels=t.labelnames)
