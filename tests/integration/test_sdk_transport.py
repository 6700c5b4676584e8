"""The SDK's HTTP transports against a scripted fake gateway (no stack): retries with
Retry-After, timeouts, SSE errors and truncated streams, rate-limit headers. Sync and async."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

import zml

MODEL = "m"
ZML = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "balanced",
       "queue_depth_at_dispatch": 0, "decision_id": "d", "request_id": "r"}
OK = {"id": "x", "model": MODEL, "choices": [{"index": 0, "text": "fine"}],
      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "zml": ZML}


@dataclass
class Script:
    """Replies handed out in order (the last one repeats)."""

    replies: list[tuple[int, dict[str, str], Any]] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def next(self) -> tuple[int, dict[str, str], Any]:
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


class FakeGateway:
    def __init__(self) -> None:
        self.script = Script()
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._infer)
        app.router.add_post("/v1/chat/completions", self._infer)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._runner = runner
        self._ready.set()
        self.loop.run_forever()

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.script.seen.append({"body": body, "headers": dict(request.headers)})
        self.script.times.append(time.monotonic())
        status, headers, payload = self.script.next()
        if payload == "hang":
            await asyncio.sleep(30)
        if isinstance(payload, list):  # SSE lines
            resp = web.StreamResponse(status=status, headers={"content-type": "text/event-stream", **headers})
            await resp.prepare(request)
            for line in payload:
                await resp.write(f"data: {line if isinstance(line, str) else json.dumps(line)}\n\n".encode())
            return resp
        return web.json_response(payload, status=status, headers=headers)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def gw() -> Iterator[FakeGateway]:
    g = FakeGateway()
    yield g
    g.close()


@pytest.fixture()
def script(gw: FakeGateway) -> Script:
    gw.script = Script()
    return gw.script


def err(code: str, status: int, retry_after: float | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"message": f"{code} happened", "type": "x", "code": code}
    if retry_after is not None:
        e["retry_after"] = retry_after
    return {"error": e}


def call(gw: FakeGateway, kind: str, **client_kw: Any) -> zml.InferResult:
    if kind == "sync":
        with zml.Client(gw.url, **client_kw) as c:
            return c.infer(MODEL, "hi", max_tokens=1)

    async def go() -> zml.InferResult:
        async with zml.AsyncClient(gw.url, **client_kw) as c:
            return await c.infer(MODEL, "hi", max_tokens=1)
    return asyncio.run(go())


KINDS = ["sync", "async"]


@pytest.mark.parametrize("kind", KINDS)
def test_429_with_retry_after_is_retried_after_that_long(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(429, {"retry-after": "0.3"}, err("RATE_LIMITED", 429)), (200, {}, OK)]
    r = call(gw, kind)
    assert r.text == "fine" and r.metrics.retries == 1
    assert 0.28 <= script.times[1] - script.times[0] < 0.9
    # Each attempt carries a fresh request id.
    assert script.seen[0]["body"]["request_id"] != script.seen[1]["body"]["request_id"]


@pytest.mark.parametrize("kind", KINDS)
def test_queue_full_then_backend_error_then_ok(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(503, {}, err("QUEUE_FULL", 503, retry_after=0.1)),
                      (502, {}, err("BACKEND_ERROR", 502, retry_after=0.1)), (200, {}, OK)]
    assert call(gw, kind).metrics.retries == 2


@pytest.mark.parametrize("kind", KINDS)
def test_retries_give_up_after_max_retries(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(503, {"retry-after": "0.05"}, err("NO_HEALTHY_NODES", 503))]
    with pytest.raises(zml.NoHealthyNodesError):
        call(gw, kind, max_retries=2)
    assert len(script.seen) == 3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("code", "status", "cls"), [("AUTH_FAILED", 401, zml.AuthError),
                                                      ("BAD_REQUEST", 400, zml.BadRequestError),
                                                      ("POLICY_CONFIG", 400, zml.PolicyConfigError)])
def test_non_transient_errors_are_raised_at_once(gw: FakeGateway, script: Script, kind: str, code: str, status: int,
                                                 cls: type[zml.ZMLError]) -> None:
    script.replies = [(status, {}, err(code, status)), (200, {}, OK)]
    with pytest.raises(cls):
        call(gw, kind)
    assert len(script.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_is_a_retryable_timeout_error(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(200, {}, "hang"), (200, {}, OK)]
    t0 = time.monotonic()
    if kind == "sync":
        with zml.Client(gw.url, max_retries=0) as c, pytest.raises(zml.TimeoutError):
            c.infer(MODEL, "hi", max_tokens=1, timeout=0.2)
    else:
        async def go() -> None:
            async with zml.AsyncClient(gw.url, max_retries=0) as c:
                with pytest.raises(zml.TimeoutError):
                    await c.infer(MODEL, "hi", max_tokens=1, timeout=0.2)
        asyncio.run(go())
    assert time.monotonic() - t0 < 0.2 + 2.0 + 1.0  # the server's timeout plus the client's grace
    assert script.seen[0]["body"]["timeout_ms"] == 200


CHUNK = {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}


def stream_texts(gw: FakeGateway, kind: str, **client_kw: Any) -> list[str]:
    if kind == "sync":
        with zml.Client(gw.url, **client_kw) as c:
            return [ch.text for ch in c.infer_stream(MODEL, "hi", max_tokens=3)]

    async def go() -> list[str]:
        async with zml.AsyncClient(gw.url, **client_kw) as c:
            return [ch.text async for ch in c.infer_stream(MODEL, "hi", max_tokens=3)]
    return asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_stream_error_after_start_raises_its_class(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(200, {"x-zml-node-id": "n1"}, [CHUNK, err("BACKEND_ERROR", 502)])]
    got: list[str] = []
    with pytest.raises(zml.BackendError):
        if kind == "sync":
            with zml.Client(gw.url) as c:
                for ch in c.infer_stream(MODEL, "hi"):
                    got.append(ch.text)
        else:
            async def go() -> None:
                async with zml.AsyncClient(gw.url) as c:
                    async for ch in c.infer_stream(MODEL, "hi"):
                        got.append(ch.text)
            asyncio.run(go())
    assert got == ["tok"] and len(script.seen) == 1  # not retried once output was seen


@pytest.mark.parametrize("kind", KINDS)
def test_stream_retried_before_first_chunk_and_truncation_detected(gw: FakeGateway, script: Script, kind: str) -> None:
    script.replies = [(429, {"retry-after": "0.05"}, err("RATE_LIMITED", 429)),
                      (200, {}, [CHUNK, CHUNK, "[DONE]"])]
    assert stream_texts(gw, kind) == ["tok", "tok"]
    script.replies = [(200, {}, [CHUNK])]  # no [DONE]: the node died mid-stream
    with pytest.raises(zml.BackendError, match="before \\[DONE\\]"):
        stream_texts(gw, kind, max_retries=0)


def test_rate_limit_headers_slow_the_client_down(gw: FakeGateway, script: Script) -> None:
    script.replies = [(200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "0.5s"}, OK),
                      (200, {}, OK)]
    with zml.Client(gw.url, rpm=6000) as c:  # 100/s locally: only the headers can slow it
        c.infer(MODEL, "hi", max_tokens=1)
        r = c.infer(MODEL, "hi", max_tokens=1)
    assert r.metrics.queue_wait_s >= 0.45
    assert script.times[1] - script.times[0] >= 0.45


def test_api_key_and_headers(gw: FakeGateway, script: Script) -> None:
    script.replies = [(200, {}, OK)]
    with zml.Client(gw.url, api_key="sk-1") as c:
        c.infer(MODEL, "hi", max_tokens=1, top_p=0.5, request_id="rid-1")
    seen = script.seen[0]
    assert seen["headers"]["Authorization"] == "Bearer sk-1"
    assert seen["body"]["top_p"] == 0.5 and seen["body"]["request_id"] == "rid-1"


# --- NATS without any ZML service ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bare_nats() -> Iterator[str]:
    import tempfile

    from zmlcore.runtime.launch import free_port, start_nats

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-bare-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.stop()


def test_nats_without_routers_is_no_healthy_nodes(bare_nats: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After waiting NO_ROUTER_GRACE_S for a router (nobody got the request: sent again as
    routers come; tests/e2e/test_gateway_no_router.py has one arrive)."""
    import zml._transport_nats as transport_nats

    grace = 0.3
    monkeypatch.setattr(transport_nats, "NO_ROUTER_GRACE_S", grace)
    with zml.Client(bare_nats, max_retries=0) as c:
        for call, match in ((lambda: c.infer(MODEL, "hi", max_tokens=1), "zml up"),
                            (lambda: list(c.infer_stream(MODEL, "hi", max_tokens=1)), "zml.infer"),
                            (c.nodes, "zml.admin.nodes.list")):
            t0 = time.monotonic()
            with pytest.raises(zml.NoHealthyNodesError, match=match):
                call()
            assert grace <= time.monotonic() - t0 < grace + 1.5

    async def go() -> None:
        async with zml.AsyncClient(bare_nats, max_retries=1) as c:
            t0 = time.monotonic()
            with pytest.raises(zml.NoHealthyNodesError):
                await c.infer(MODEL, "hi", max_tokens=1)
            assert time.monotonic() - t0 >= 2 * grace + 0.9  # waited, retried once after 1 s, waited
    asyncio.run(go())
