"""Who stops the gateway on SIGTERM: the shared runner, as in every service (issue 18).

uvicorn's own signal handlers are kept out (zml_gateway.uvicorninternals.GatewayServer), so the
runner's ordered stop is the only one: the listener closes at once, a stream in flight runs to
its end, and the process exits 0 without a traceback. A stand-in router (the test's own
subscriber in the routers' queue group) streams slowly enough to send the signal mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import nats
import pytest

from zmlcore import subjects
from zmlcore.runtime.launch import free_port, service_argv, spawn, wait_port
from zmlcore.bus.publish import flush

MODEL = "slow/model"
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}
CHUNKS = 8
GAP_S = 0.25


def _chunk(text: str) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}).encode()


@pytest.fixture()
async def slow_router(own_nats: str) -> AsyncIterator[None]:
    """Streams start, CHUNKS chunks GAP_S apart, then end."""
    nc = await nats.connect(own_nats)
    tasks: set[asyncio.Task[None]] = set()

    async def stream(reply: str, rid: str) -> None:
        routing = json.dumps({"routing": {**ROUTING, "request_id": rid}}).encode()
        out = [(routing, {subjects.H_STREAM: "start", subjects.H_NODE_ID: "n1"})]
        out += [(_chunk(f"w{i} "), {subjects.H_STREAM: subjects.STREAM_CHUNK}) for i in range(CHUNKS)]
        out.append((routing, {subjects.H_STREAM: subjects.STREAM_END}))
        for seq, (data, headers) in enumerate(out):
            await nc.publish(reply, data, headers={**headers, subjects.H_SEQ: str(seq)})
            await asyncio.sleep(GAP_S)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(stream(msg.reply, (msg.headers or {}).get(subjects.H_REQUEST_ID, "r")))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    sub = await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=serve)
    await flush(nc)
    try:
        yield
    finally:
        await sub.unsubscribe()
        for task in tasks:
            task.cancel()
        await nc.close()


async def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0(
        own_nats: str, slow_router: None, tmp_path: Path) -> None:
    config = tmp_path / "zml.toml"
    config.write_text("[defaults]\nrequest_timeout_s = 20\n")
    port = free_port()
    gw = spawn("gateway", service_argv("gateway", str(config), own_nats, "--port", str(port)))
    try:
        assert await asyncio.to_thread(wait_port, "127.0.0.1", port, 30), gw.tail(30)
        url = f"http://127.0.0.1:{port}"
        lines: list[str] = []
        first = asyncio.Event()

        async def read() -> int:
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                async with client.stream("POST", "/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            first.set()
                    return r.status_code

        reading = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 10)
        gw.terminate()  # SIGTERM, mid-stream
        t0 = time.monotonic()
        refused = False
        while not reading.done() and time.monotonic() - t0 < 2:
            try:
                async with httpx.AsyncClient(timeout=1) as probe:
                    await probe.get(url + "/healthz")
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                # Refused, or (a connection the kernel had queued as the listener closed) closed
                # unanswered: either way no new request is served once the stop has begun.
                refused = True
                break
            await asyncio.sleep(0.05)
        assert refused, "the listener still took connections after SIGTERM"
        assert not reading.done(), "the stream ended before the listener closed"
        assert await asyncio.wait_for(reading, 20) == 200
        assert lines[-1] == "data: [DONE]", lines[-3:]
        words = [json.loads(ln[6:])["choices"][0]["delta"].get("content") for ln in lines[:-1]
                 if ln.startswith("data: {") and json.loads(ln[6:]).get("choices")]
        assert [w for w in words if w] == [f"w{i} " for i in range(CHUNKS)]
        code = await asyncio.to_thread(gw.popen.wait, 15)
        assert code == 0, gw.tail(30)
        assert gw.tracebacks == 0, gw.tail(30)
        assert gw.wait_for("zml-gateway stopping", 1), gw.tail(30)
    finally:
        gw.stop()
