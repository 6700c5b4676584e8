#!/usr/bin/env python3
"""CPU cost of the observability hooks one request runs through, in-process and without noise
from the rest of the stack: the router's metrics hooks (decision timing, decision counter,
usage, finish) and the gateway's ASGI wrapper (status + duration), tracing off; then the same
with tracing on (100% sampling, spans exported to nowhere by an in-memory exporter).

    python benches/metrics_overhead.py            # prints microseconds per request

Compare with the stack's CPU per request from benches/peers_path.py (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from zmlcore.config import ZMLConfig
from zmlcore.telemetry import tracing
from zmlcore.policy import Decision, RouteRequest
from zml_gateway.observe import Observed
from zml_router.telemetry import tracing as rtrace
from zml_router.telemetry.metrics import RouterMetrics
from zml_router.replicas.table import NodeTable

N = 20_000
RAW = b'{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":20,"total_tokens":32}}'


class _Out:
    __slots__ = ("model", "node_id", "family", "ok", "error_code", "queued", "info", "op", "attempts")

    def __init__(self) -> None:
        self.model, self.node_id, self.family, self.ok, self.error_code = "m", "n1", "H100", True, ""
        self.queued, self.op, self.attempts = False, "chat", 1
        self.info = SimpleNamespace(policy="balanced", time_to_first_token=0.05, decision_id="d")


def router_request(m: RouterMetrics, decision: Decision, rr: RouteRequest) -> None:
    m.decide(lambda rr, p: decision, rr, None)
    m.dispatching({}, SimpleNamespace(decision_id="d"))  # type: ignore[arg-type]
    m.usage_dict("chat", "m", {"prompt_tokens": 12, "completion_tokens": 20, "total_tokens": 32})
    m.finished(_Out(), 0.1)  # type: ignore[arg-type]


async def gateway_requests(n: int) -> float:
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):  # type: ignore[no-untyped-def]
        pass

    async def receive():  # type: ignore[no-untyped-def]
        return {}

    wrapped = Observed(app)  # type: ignore[arg-type]
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": [], "client": ("127.0.0.1", 1)}
    t = time.process_time()
    for _ in range(n):
        await wrapped(scope, receive, send)
    wrapped_s = time.process_time() - t
    t = time.process_time()
    for _ in range(n):
        await app(scope, receive, send)
    return (wrapped_s - (time.process_time() - t)) / n


async def router_traced(m: RouterMetrics, decision: Decision, rr: RouteRequest, n: int) -> float:
    async def handle(msg):  # type: ignore[no-untyped-def]
        router_request(m, decision, rr)

    msg = SimpleNamespace(headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    t = time.process_time()
    for _ in range(n):
        await rtrace.handle("r1", msg, handle)  # type: ignore[arg-type]
    return (time.process_time() - t) / n


def main() -> None:
    m = RouterMetrics(ZMLConfig(), NodeTable(), {})
    decision = Decision(node_id="n1", family="H100", policy="balanced", queue_depth=0, estimated_ttft_s=0.1)
    rr = RouteRequest(model="m", max_tokens=20)
    for _ in range(1000):
        router_request(m, decision, rr)
    t = time.process_time()
    for _ in range(N):
        router_request(m, decision, rr)
    router_off = (time.process_time() - t) / N
    gateway_off = asyncio.run(gateway_requests(N))

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=N * 4))
    trace.set_tracer_provider(provider)
    tracing.enable()
    router_on = asyncio.run(router_traced(m, decision, rr, N // 4))
    print(f"router hooks, tracing off: {router_off * 1e6:.1f} us/request")
    print(f"gateway wrapper, tracing off: {gateway_off * 1e6:.1f} us/request")
    print(f"router hooks + spans, tracing on (100%, spans recorded, not sent): {router_on * 1e6:.1f} us/request")


if __name__ == "__main__":
    main()
