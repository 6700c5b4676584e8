"""Prometheus metrics shared by every service (prometheus_client: the reference client, so the
exposition format, locking and process metrics are not ours to get wrong).

Each service defines its metrics in its own ``metrics`` module; this one holds the common
pieces: bucket layouts, label-child caches for the hot path, and the small HTTP server that
the router, health and warmup services expose ``/metrics`` on (the gateway serves it itself).

    from zmlcore.telemetry.metrics import Children, serve_metrics
    requests = Children(Counter("zml_x_requests", "...", ["model", "code"]))
    requests("llama", "OK").inc()          # a cached child: no label dict per call
    port = serve_metrics("127.0.0.1", 0)   # a free port; the metrics of this process
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("zml.metrics")

#: OpenTelemetry GenAI's advised buckets for gen_ai.server.time_to_first_token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
#: ...for gen_ai.server.request.duration (and ZML's end-to-end latency).
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
#: ...for gen_ai.client.token.usage.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
#: Routing decisions are pure in-memory maths: tens of microseconds.
DECISION_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
#: Waits in the saturation queue and model loads: up to many minutes.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

#: Label combinations kept per metric; past this, new ones share the value "other" (a caller
#: sending random model names must not grow the process without bound).
MAX_CHILDREN = 2000

CONTENT_TYPE = CONTENT_TYPE_LATEST

M = TypeVar("M")


class Children(Generic[M]):
    """A metric's label children, built once per label tuple and then looked up in a dict
    (``metric.labels(...)`` validates and builds a key on every call)."""

    __slots__ = ("metric", "_cache", "_lock")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._cache: dict[tuple[str, ...], M] = {}
        self._lock = threading.Lock()

    def __call__(self, *values: str) -> M:
        child = self._cache.get(values)
        if child is None:
            child = self._make(values)
        return child

    def _make(self, values: tuple[str, ...]) -> M:
        with self._lock:
            if len(self._cache) >= MAX_CHILDREN:
                values = tuple("other" for _ in values)
                if values in self._cache:
                    return self._cache[values]
            child = self.metric.labels(*values)  # type: ignore[attr-defined]
            self._cache[values] = child
            return child  # type: ignore[no-any-return]


def exposition() -> bytes:
    """This process's metrics in Prometheus text format."""
    return generate_latest(REGISTRY)


class MetricsServer:
    """``/metrics`` on a port of its own (prometheus_client's threaded server: a scrape never
    waits on the event loop, and the loop never waits on a scrape)."""

    def __init__(self, host: str, port: int) -> None:
        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host)
        self.host = host
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(host: str, port: int) -> MetricsServer:
    server = MetricsServer(host, port)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server
