"""One trace per request through the stack, received by a real OTLP/HTTP endpoint in the test
(protobuf parsed with opentelemetry-proto): gateway span -> router span -> attempt span ->
the node's request carries traceparent; a caller's traceparent is continued (HTTP header, raw
NATS header, SDK span via the SDK's in-memory exporter); failover attempts end with their
failure class; JSON log lines carry request, decision and trace ids; prompts are never exported.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, format_span_id, format_trace_id

from conftest import MODEL, Stack, launch_stack
from zmlcore.runtime.launch import service_argv, spawn
from zmlcore import subjects

PROMPT = "the secret prompt text 7f3a"
FLEET2 = [("h100-1", "nvidia_h100", [MODEL]), ("a100-1", "nvidia_a100", [MODEL])]
KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


class Receiver:
    """An OTLP/HTTP endpoint: POST /v1/traces (spans, flattened) and /v1/metrics (requests kept
    whole, for tests/e2e/test_otlp_metrics.py), protobuf."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                ok = self.headers.get("content-type") == "application/x-protobuf"
                if ok and self.path == "/v1/metrics":
                    with receiver.lock:
                        receiver.metrics.append(ExportMetricsServiceRequest.FromString(body))
                    out = ExportMetricsServiceResponse().SerializeToString()
                else:
                    ok = ok and self.path == "/v1/traces"
                    if ok:
                        receiver.add(ExportTraceServiceRequest.FromString(body))
                    out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: ExportTraceServiceRequest) -> None:
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs: dict[str, Any] = {}
                    for a in s.attributes:
                        v = a.value
                        kind = v.WhichOneof("value")
                        attrs[a.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                                        else getattr(v, kind))
                    with self.lock:
                        self.spans.append({
                            "service": service, "name": s.name, "kind": KINDS.get(s.kind, str(s.kind)),
                            "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "attrs": attrs, "status": s.status.code,
                            "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        })

    def trace(self, trace_id: str, want: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [s for s in self.spans if s["trace_id"] == trace_id]
            if len(got) >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    receiver = Receiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_TRACES_SAMPLER": "always_on", "ZML_LOG_FORMAT": "json"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the services started below inherit it (spawn copies os.environ)
    try:
        stack = launch_stack(own_nats, tmp_path_factory.mktemp("traced"), fleet=FLEET2, routers=1,
                             extra='[policies.queued]\naccelerator_chain = ["H100", "A100"]\n'
                                   'queue_on_saturation = true\nmax_queue_ms = 20000\n')
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield stack, receiver
    finally:
        stack.stop()
        receiver.close()


@pytest.fixture(scope="module")
def caller() -> Iterator[tuple[Any, InMemorySpanExporter]]:
    """The application calling ZML: its own tracer, exporting in memory (not installed globally)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("app"), exporter
    provider.shutdown()


def by(spans: list[dict[str, Any]], service: str, kind: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["service"] == service and s["kind"] == kind]


def no_prompt(spans: list[dict[str, Any]]) -> None:
    assert PROMPT not in json.dumps(spans, default=str)


def body(stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": PROMPT}]}
    if stream:
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_http_request_is_one_trace_continuing_the_callers(traced: tuple[Stack, Receiver],
                                                             caller: tuple[Any, InMemorySpanExporter],
                                                             stream: bool) -> None:
    from opentelemetry.propagate import inject

    stack, receiver = traced
    tracer, exporter = caller
    with tracer.start_as_current_span("app.call") as app_span:
        headers: dict[str, str] = {}
        inject(headers)  # the caller's traceparent, as any instrumented HTTP client sends it
        with httpx.Client(base_url=stack.gateway_url, timeout=30) as http:
            if stream:
                with http.stream("POST", "/v1/chat/completions", json=body(True), headers=headers) as r:
                    assert r.status_code == 200
                    r.read()
                    decision = r.headers["x-zml-decision-id"]
                    node = r.headers["x-zml-node-id"]
            else:
                r = http.post("/v1/chat/completions", json=body(), headers=headers)
                assert r.status_code == 200, r.text
                decision, node = r.json()["zml"]["decision_id"], r.json()["zml"]["node_id"]
    trace_id = format_trace_id(app_span.get_span_context().trace_id)
    app_id = format_span_id(app_span.get_span_context().span_id)
    assert [s.name for s in exporter.get_finished_spans() if s.context.span_id == app_span.get_span_context().span_id]
    spans = receiver.trace(trace_id, want=3)
    gw = by(spans, "zml-gateway", "SERVER")
    rt = by(spans, "zml-router", "SERVER")
    at = by(spans, "zml-router", "CLIENT")
    assert len(gw) == 1 and len(rt) == 1 and len(at) == 1, spans
    assert gw[0]["parent"] == app_id  # the caller's trace is continued, not replaced
    assert rt[0]["parent"] == gw[0]["span_id"]
    assert at[0]["parent"] == rt[0]["span_id"]
    assert gw[0]["attrs"]["http.response.status_code"] == 200
    a = rt[0]["attrs"]
    assert rt[0]["name"] == f"chat {MODEL}"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.response.model"] == MODEL and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.usage.input_tokens"] > 0
    assert a["zml.decision_id"] == decision and a["zml.node_id"] == node and a["zml.policy"]
    assert a["zml.candidates"] and a["zml.family"] and "zml.estimated_ttft_s" in a and "zml.queue_depth" in a
    assert at[0]["attrs"]["zml.node_id"] == node and at[0]["attrs"]["zml.decision_id"] == decision
    # The node received the attempt span as its parent.
    if os.environ.get("ZML_SCREENSHOT_DIR") and not stream:  # the trace picture in docs/observability.md
        Path(os.environ["ZML_SCREENSHOT_DIR"], "trace.json").write_text(json.dumps(spans, indent=1, default=str))
    tp = stack.sim_state(node)["last_traceparent"]
    assert tp.startswith(f"00-{trace_id}-{at[0]['span_id']}-"), tp  # flags: sampled (+ random)
    no_prompt(spans)


def test_raw_nats_traceparent_is_continued(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()

    async def call() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            msg = await nc.request(subjects.INFER, json.dumps(body()).encode(), timeout=20,
                                   headers={"traceparent": f"00-{trace_id}-{parent}-01"})
            assert subjects.H_ERROR_CODE not in (msg.headers or {}), msg.data
        finally:
            await nc.close()

    asyncio.run(call())
    spans = receiver.trace(trace_id, want=2)
    rt = by(spans, "zml-router", "SERVER")
    assert len(rt) == 1 and rt[0]["parent"] == parent
    assert by(spans, "zml-router", "CLIENT")[0]["parent"] == rt[0]["span_id"]
    no_prompt(spans)


@pytest.mark.parametrize("transport", ["nats", "http", "grpc"])
def test_the_sdk_sends_the_callers_context(traced: tuple[Stack, Receiver],
                                           caller: tuple[Any, InMemorySpanExporter], transport: str) -> None:
    import zml

    stack, receiver = traced
    tracer, exporter = caller
    endpoint = {"nats": stack.nats_url, "http": stack.gateway_url, "grpc": f"grpc://{stack.grpc_target}"}[transport]
    with tracer.start_as_current_span("app.sdk") as app_span:
        with zml.Client(endpoint, timeout=20, max_retries=0) as client:
            result = client.infer(MODEL, prompt=PROMPT, max_tokens=3)
            assert result.text
    ctx = app_span.get_span_context()
    assert any(s.context.span_id == ctx.span_id for s in exporter.get_finished_spans())
    spans = receiver.trace(format_trace_id(ctx.trace_id), want=2 if transport == "nats" else 3)
    rt = by(spans, "zml-router", "SERVER")
    first = by(spans, "zml-gateway", "SERVER")[0] if transport != "nats" else rt[0]
    assert len(rt) == 1 and first["parent"] == format_span_id(ctx.span_id)
    assert rt[0]["attrs"]["gen_ai.operation.name"] == "text_completion"
    no_prompt(spans)


def test_a_failover_is_a_failed_attempt_span_and_logs_carry_the_ids(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    found = None
    failing = ""
    try:
        with httpx.Client(base_url=stack.gateway_url, timeout=30) as http:
            for _ in range(30):
                trace_id = os.urandom(16).hex()
                r = http.post("/v1/chat/completions", json=body(),
                              headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
                assert r.status_code == 200, r.text
                meta = r.json()["zml"]
                if meta["attempts"] > 1:
                    found = (trace_id, meta)
                    break
                if meta["node_id"] != failing:
                    # the node the router now prefers (by its learned speeds) fails from here on:
                    # the next request tried there fails over to the other
                    failing = meta["node_id"]
                    stack.faults(failing, error_rate=1.0)
                    stack.faults("a100-1" if failing == "h100-1" else "h100-1", error_rate=0.0)
                time.sleep(0.3)  # a failed node cools down for 2 s; then it is tried again
    finally:
        stack.clear_faults()
    assert found is not None, "no request failed over in 30 tries"
    trace_id, zml_meta = found
    spans = receiver.trace(trace_id, want=4)
    rt = by(spans, "zml-router", "SERVER")[0]
    attempts = sorted(by(spans, "zml-router", "CLIENT"), key=lambda s: s["start"])
    assert len(attempts) == zml_meta["attempts"]
    assert all(s["parent"] == rt["span_id"] for s in attempts)
    assert attempts[0]["attrs"]["zml.node_id"] == failing
    assert attempts[0]["attrs"]["zml.failure_class"] == "server" and attempts[0]["status"] == 2  # ERROR
    assert attempts[-1]["attrs"]["zml.node_id"] == zml_meta["node_id"] and "zml.failure_class" not in attempts[-1]["attrs"]
    assert rt["attrs"]["zml.attempts"] == zml_meta["attempts"]
    # The router's JSON log line about the failover carries the request's ids.
    router = stack.procs["router-1"]
    deadline = time.monotonic() + 10
    line = None
    while line is None and time.monotonic() < deadline:
        for raw in list(router.lines):
            if raw.startswith("{") and trace_id in raw:
                line = json.loads(raw)
                break
        time.sleep(0.2)
    assert line is not None, router.tail()
    assert line["trace_id"] == trace_id and line["request_id"] == zml_meta["request_id"]
    assert line["decision_id"] and line["service"] == "zml-router" and line["level"] in ("info", "warning")
    assert all(PROMPT not in raw for p in stack.procs.values() for raw in list(p.lines))


def test_the_saturation_queue_wait_is_a_span_of_the_same_trace(traced: tuple[Stack, Receiver]) -> None:
    stack, receiver = traced
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    for node in stack.node_ids:
        stack.faults(node, overload=True, retry_after_s=0.5)

    async def call() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            request = asyncio.ensure_future(nc.request(
                subjects.INFER, json.dumps({**body(), "policy": "queued", "timeout_ms": 25000}).encode(), timeout=30,
                headers={"traceparent": f"00-{trace_id}-{parent}-01"}))
            await asyncio.sleep(1.5)
            assert not request.done()  # waiting in the queue
            for node in stack.node_ids:
                stack.faults(node, overload=False)
            msg = await request
            assert subjects.H_ERROR_CODE not in (msg.headers or {}), msg.data
        finally:
            await nc.close()

    try:
        asyncio.run(call())
    finally:
        stack.clear_faults()
    spans = receiver.trace(trace_id, want=4)
    servers = sorted(by(spans, "zml-router", "SERVER"), key=lambda s: s["start"])
    waits = [s for s in spans if s["name"] == "zml.queue.wait"]
    assert len(waits) == 1, spans
    first = servers[0]
    assert first["parent"] == parent and first["attrs"].get("zml.queued") is True
    assert waits[0]["parent"] == first["span_id"]
    assert waits[0]["attrs"]["zml.queue_wait_s"] >= 1.0
    served = servers[-1]  # the router that served it from the queue continues the same trace
    # (every span in the message: it failed once in a full run at load 5-11, passing alone)
    assert served["parent"] == first["span_id"] and served["attrs"]["zml.node_id"], spans
    no_prompt(spans)


def test_each_batch_line_is_a_trace_linked_to_its_batch(traced: tuple[Stack, Receiver]) -> None:
    """The Batch API: the request that creates a batch is a span; every line the runner sends is
    a trace of its own (router and node spans under it), linked to that span."""
    stack, receiver = traced
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_TRACES_SAMPLER": "always_on"}
    stack.procs["batch"] = spawn("batch", service_argv("batch", stack.config_path, stack.nats_url), env=env)
    rows = "\n".join(json.dumps({"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body()}) for i in range(3))
    with httpx.Client(base_url=stack.gateway_url, timeout=20) as http:
        f = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("t.jsonl", rows.encode())}).json()
        trace_id = os.urandom(16).hex()
        b = http.post("/v1/batches", headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
                      json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                            "completion_window": "24h"}).json()
        deadline = time.monotonic() + 60
        while http.get(f"/v1/batches/{b['id']}").json()["status"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.3)
    created = receiver.trace(trace_id, 1)
    create = next(s for s in created if s["name"] == "POST /v1/batches")
    assert create["attrs"]["zml.batch.id"] == b["id"] and create["attrs"]["zml.batch.lines"] == 3
    deadline = time.monotonic() + 30
    while True:
        with receiver.lock:
            lines = [s for s in receiver.spans if s["name"] == "zml.batch.line"
                     and s["attrs"].get("zml.batch.id") == b["id"]]
        if len(lines) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(s["attrs"]["zml.batch.custom_id"] for s in lines) == ["t0", "t1", "t2"]
    for line in lines:
        assert line["service"] == "zml-batch" and line["trace_id"] != trace_id and not line["parent"]
        assert (trace_id, create["span_id"]) in line["links"]
        assert by(receiver.trace(line["trace_id"], 2), "zml-router", "SERVER"), "the router continues the line"
    no_prompt(receiver.spans)
