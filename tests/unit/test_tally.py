"""zmlcore.telemetry.tally: per-request counts as plain numbers, exposed exactly like prometheus_client's
own Counter and Histogram (what a scrape of /metrics reads must not change)."""

from __future__ import annotations

import random
import re
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from zmlcore.telemetry import metrics
from zmlcore.telemetry.tally import CounterTally, HistogramTally, Tallies

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _without_created_values(text: str) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1", text)


def test_exposition_matches_prometheus_client() -> None:
    ref, tal = CollectorRegistry(), CollectorRegistry()
    h = Histogram("t_seconds", "doc h", ["op", "node"], buckets=BUCKETS, registry=ref)
    c = Counter("t_requests", "doc c", ["code"], registry=ref)
    ht = HistogramTally("t_seconds", "doc h", ["op", "node"], BUCKETS)
    ct = CounterTally("t_requests", "doc c", ["code"])
    tal.register(Tallies(ht, ct))
    rnd = random.Random(7)
    # Bucket edges exactly, between them, below the first, above the last (+Inf), zero, ints.
    values = [0, 0.001, 0.0010001, 0.01, 0.5, 1, 10.0, 10.5, 1e9, -1.0] + [rnd.random() * 20 for _ in range(500)]
    for v in values:
        labels = (rnd.choice(["chat", "text_completion"]), rnd.choice(["n1", "n2"]))
        h.labels(*labels).observe(v)
        ht.observe(labels, v)
        code = rnd.choice(["OK", "TIMEOUT"])
        c.labels(code).inc()
        ct.inc((code,))
    got = generate_latest(tal).decode()
    assert _without_created_values(got) == _without_created_values(generate_latest(ref).decode())
    assert re.search(r't_seconds_created\{node="n\d",op="\w+"\} \d', got)
    assert ref.get_sample_value("t_seconds_count", {"op": "chat", "node": "n1"}) == \
        tal.get_sample_value("t_seconds_count", {"op": "chat", "node": "n1"}) > 0


def test_label_sets_are_capped(monkeypatch) -> None:
    monkeypatch.setattr(metrics, "MAX_CHILDREN", 3)
    reg = CollectorRegistry()
    ct = CounterTally("t_capped", "test", ["model"])
    reg.register(Tallies(ct))
    for i in range(10):  # a caller sending random model names
        ct.inc((f"m{i}",))
    text = generate_latest(reg).decode()
    assert 't_capped_total{model="other"} 7.0' in text
    assert text.count("t_capped_total{") == 3 + 1  # the first three, then "other"


def test_a_scrape_racing_the_writer_stays_consistent() -> None:
    """A scrape runs in prometheus_client's thread while the loop observes: every histogram it
    reads has _count equal to its +Inf bucket, and nothing raises."""
    reg = CollectorRegistry()
    ht = HistogramTally("t_race", "test", ["k"], BUCKETS)
    reg.register(Tallies(ht))
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        try:
            while not stop.is_set():
                for fam in reg.collect():
                    per: dict[str, dict[str, float]] = {}
                    for s in fam.samples:
                        d = per.setdefault(s.labels.get("k", ""), {})
                        if s.name.endswith("_count"):
                            d["count"] = s.value
                        elif s.name.endswith("_bucket") and s.labels["le"] == "+Inf":
                            d["inf"] = s.value
                    for d in per.values():
                        assert d["count"] == d["inf"]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(200_000):
            ht.observe((f"k{i % 500}",), i * 1e-5)  # new label sets while the scrape iterates
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert sum(sum(ht.value((f"k{i}",))[:-1]) for i in range(500)) == 200_000  # every observation counted
