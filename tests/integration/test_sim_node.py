"""A simulated node over real HTTP: every endpoint, every engine imitation, every fault, the CLI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from zmlcore.config import parse_config
from zml_sim.server import SimNode
from zml_sim.server import start_fleet
from zmlcore.runtime.launch import free_port

M = "llama-3-8b"
CHAT = {"model": M, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 12}


def sse(lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def refused(url: str) -> bool:
    async with httpx.AsyncClient(timeout=1.0) as c:
        try:
            await c.get(url + "/health")
        except httpx.ConnectError:
            return True
        return False


async def eventually(check: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture
async def node() -> AsyncIterator[SimNode]:
    n = SimNode("h100-1", "nvidia_h100", [M], time_scale=50.0, load_time_s=0.0, seed=1)
    await n.start()
    yield n
    await n.stop()


@pytest.fixture
async def client(node: SimNode) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=node.url, timeout=5.0) as c:
        yield c


# ----- OpenAI API ------------------------------------------------------------------------------


async def test_chat_completion(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == M
    assert body["id"] and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].startswith("[h100-1] ")
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_without_max_tokens_stops_at_a_sampled_length(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": None})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 1 <= body["usage"]["completion_tokens"] <= 2048


async def test_completion(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": M, "prompt": "hello world!", "max_tokens": 4})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"].startswith("[h100-1] ")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_stream_with_usage(client: httpx.AsyncClient) -> None:
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text.startswith("[h100-1] ") and len(text.split()) == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_completion_stream_without_usage(client: httpx.AsyncClient) -> None:
    req = {"model": M, "prompt": "hi", "max_tokens": 5, "stream": True}
    async with client.stream("POST", "/v1/completions", json=req) as r:
        events = sse([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in events[:-1]).split()[0] == "[h100-1]"


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", json.dumps({"model": M}).encode(),
                json.dumps({**CHAT, "max_tokens": 0}).encode()],
)
async def test_bad_requests_get_openai_errors(client: httpx.AsyncClient, content: bytes) -> None:
    r = await client.post("/v1/chat/completions", content=content,
                          headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


async def test_unknown_model_is_404_like_vllm(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and err["code"] == 404 and "nope" in err["message"]


async def test_models_and_node_probe(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [M]
    probe = (await client.get("/zml/v1/node")).json()
    assert probe == {
        "node_id": "h100-1", "accelerator_type": "nvidia_h100", "device_count": 1,
        "driver_version": "525.85", "memory_gib": 80.0, "free_memory_gib": 64.0, "engine": "vllm", "models": [M],
        "loading_models": [],
    }


async def test_metrics_use_vllm_names(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", json=CHAT)
    text = (await client.get("/metrics")).text
    label = f'model_name="{M}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert f"{name}{{{label}}} 0.0" in text
    assert f"vllm:prompt_tokens_total{{{label}}} 100.0" in text
    assert f"vllm:generation_tokens_total{{{label}}} 12.0" in text
    assert f'vllm:request_success_total{{{label},finished_reason="length"}} 1.0' in text
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert f"# TYPE {hist} histogram" in text
        assert f'{hist}_bucket{{{label},le="+Inf"}} 1.0' in text
        assert f"{hist}_count{{{label}}} 1.0" in text and f"{hist}_sum{{{label}}}" in text


async def test_runtime_load_and_unload(node: SimNode, client: httpx.AsyncClient) -> None:
    await client.post("/sim/profile", json={"load_time_s": 10.0})  # 0.2 s at time_scale 50
    r = await client.post("/sim/load", json={"model": "other"})
    assert r.status_code == 202
    state = (await client.get("/sim/state")).json()
    assert "other" in state["loading"] and state["models"] == [M]
    assert (await client.get("/health")).status_code == 200  # vLLM: no 503 for a second model
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [M]
    assert (await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})).status_code == 404
    await node.engine.wait_loaded("other")
    assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [M, "other"]
    assert (await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})).status_code == 200
    assert (await client.get("/sim/state")).json()["free_memory_gib"] == pytest.approx(48.0)
    assert (await client.post("/sim/unload", json={"model": "other"})).status_code == 200
    assert (await client.post("/sim/unload", json={"model": "other"})).status_code == 404


async def test_state_reports_queue_batch_and_counters(node: SimNode, client: httpx.AsyncClient) -> None:
    await client.post("/sim/profile", json={"max_concurrency": 1})
    reqs = [asyncio.ensure_future(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500}))
            for _ in range(3)]
    await eventually(lambda: _state_is(client, lambda s: s["queue"]["waiting"] == 2))
    state = (await client.get("/sim/state")).json()
    assert state["batch"]["running"] == 1 and state["kv_cache_usage"] > 0
    await asyncio.gather(*reqs)
    state = (await client.get("/sim/state")).json()
    assert state["counters"][M]["success"]["length"] == 3


async def _state_is(client: httpx.AsyncClient, pred: Any) -> bool:
    return bool(pred((await client.get("/sim/state")).json()))


async def test_client_disconnect_frees_the_slot(node: SimNode, client: httpx.AsyncClient) -> None:
    req = {**CHAT, "max_tokens": 2000, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=req) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    await eventually(lambda: _state_is(client, lambda s: s["batch"]["running"] == 0))


async def test_client_timeout_on_a_plain_request_frees_the_slot(client: httpx.AsyncClient) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}, timeout=0.2)
    await eventually(lambda: _state_is(client, lambda s: s["batch"]["running"] == 0))


# ----- engine imitations -----------------------------------------------------------------------


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_a_client_gone_before_its_headers_is_no_traceback(
        node: SimNode, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, reset: bool) -> None:
    """Callers that send a streamed request and close at once (a burst of hostile raw requests,
    a client killed): the node writes its headers to a closing transport, which aiohttp reports
    as an "Error handling request" traceback unless the node takes it as the normal end it is."""
    import struct

    body = json.dumps({**CHAT, "max_tokens": 5, "stream": True}).encode()
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        _, w = await asyncio.open_connection(node.host, node.port)
        w.write(raw)
        await w.drain()
        if reset:
            w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.close()
    await eventually(lambda: _state_is(client, lambda s: s["batch"]["running"] == 0))
    await asyncio.sleep(0.2)  # any handler still writing has finished
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
    assert gone, "the closed connections were not seen at all"
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

@pytest.mark.timeout(20)
@pytest.mark.parametrize("engine", ["vllm", "tgi", "openai"])
async def test_vllm_and_tgi_refuse_connections_while_loading(engine: str) -> None:
    n = SimNode(f"{engine}-1", "nvidia_h100", [M], engine=engine, time_scale=20.0, load_time_s=10.0)
    await n.start(wait=False)
    try:
        assert n.port != 0 and await refused(n.url)
        await n.wait_listening()
        async with httpx.AsyncClient(base_url=n.url) as c:
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/zml/v1/node")).json()["engine"] == engine
    finally:
        await n.stop()


@pytest.mark.timeout(20)
async def test_sglang_answers_503_until_warm() -> None:
    n = SimNode("sg-1", "amd_mi300x", [M], engine="sglang", time_scale=20.0, load_time_s=40.0)
    await n.start()
    try:
        async with httpx.AsyncClient(base_url=n.url) as c:
            assert (await c.get("/health")).status_code == 503
            assert (await c.get("/ready")).status_code == 503
            assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 503
            assert (await c.get("/zml/v1/node")).json()["loading_models"] == [M]
            await n.engine.wait_loaded(M)
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/ready")).status_code == 200
            assert (await c.get("/health_generate")).status_code == 200
            text = (await c.get("/metrics")).text
            for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
                assert f'{name}{{model_name="{M}"}}' in text
    finally:
        await n.stop()


@pytest.mark.timeout(20)
async def test_llamacpp_loading_body_slots_and_metrics() -> None:
    n = SimNode("ll-1", "intel_gaudi2", [M], engine="llamacpp", time_scale=20.0, load_time_s=40.0)
    await n.start()
    try:
        async with httpx.AsyncClient(base_url=n.url) as c:
            r = await c.get("/health")
            assert r.status_code == 503
            assert r.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            await n.engine.wait_loaded(M)
            assert (await c.get("/health")).json() == {"status": "ok"}
            slots = (await c.get("/slots")).json()
            assert len(slots) == 16 and not any(s["is_processing"] for s in slots)
            text = (await c.get("/metrics")).text
            assert "llamacpp:requests_processing 0.0" in text and "llamacpp:requests_deferred 0.0" in text
    finally:
        await n.stop()


@pytest.mark.timeout(20)
async def test_llamacpp_lora_adapters_as_llama_server_has_them() -> None:
    from zml_health.adapters.llamacpp import Lora, read_loras

    n = SimNode("ll-lora", "nvidia_h100", [M], engine="llamacpp", time_scale=50.0, load_time_s=0.0,
                loras=["/lora/pirate.gguf", "french.gguf"])
    await n.start()
    try:
        async with httpx.AsyncClient(base_url=n.url) as c:
            await n.engine.wait_loaded(M)
            # what health reads once per engine start
            assert await read_loras(c, n.url, 2.0) == [Lora(0, "/lora/pirate.gguf", 1.0), Lora(1, "french.gguf", 1.0)]
            # a request's own list: the one it names runs, the others at 0; ids out of range refused
            body = {**CHAT, "max_tokens": 2}
            assert (await c.post("/v1/chat/completions", json={**body, "lora": [{"id": 1, "scale": 1.0}]})).status_code == 200
            r = await c.post("/v1/chat/completions", json={**body, "lora": [{"id": 2, "scale": 1.0}]})
            assert r.status_code == 400 and r.json()["error"]["message"] == "invalid adapter id"
            assert (await c.post("/v1/chat/completions", json={**body, "lora": [{"id": 0, "scale": 0.0}]})).status_code == 200
            assert n.state()["lora_requests"] == {"1": 1}
            # without a list a request runs at the global scales: both on from start, then set
            assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
            assert n.state()["lora_requests"] == {"0": 1, "1": 2}
            assert (await c.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}])).json() == {"success": True}
            assert [a["scale"] for a in (await c.get("/lora-adapters")).json()] == [0.5, 0.0]
            assert (await c.post("/lora-adapters", json=[{"id": 7, "scale": 1}])).status_code == 400
    finally:
        await n.stop()
    with pytest.raises(ValueError, match="llama.cpp"):
        SimNode("v", "nvidia_h100", [M], engine="vllm", loras=["a.gguf"])


async def test_tgi_info_metrics_and_overload() -> None:
    n = SimNode("tgi-1", "nvidia_a100", [M], engine="tgi", time_scale=50.0, load_time_s=0.0)
    await n.start()
    try:
        async with httpx.AsyncClient(base_url=n.url) as c:
            assert (await c.get("/info")).json()["model_id"] == M
            text = (await c.get("/metrics")).text
            assert "tgi_queue_size 0.0" in text and "tgi_batch_current_size 0.0" in text
            await c.post("/sim/faults", json={"overload": True, "retry_after_s": 2})
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    finally:
        await n.stop()


# ----- faults ----------------------------------------------------------------------------------


async def test_overload_delay_refuses_late(client: httpx.AsyncClient) -> None:
    assert (await client.post("/sim/faults", json={"overload_delay_s": -1})).status_code == 400
    await client.post("/sim/faults", json={"overload": True, "overload_delay_s": 0.3})
    t0 = time.monotonic()
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and "overloaded" in r.text and time.monotonic() - t0 >= 0.3  # vLLM's refusal, late
    await client.post("/sim/faults", json={"overload": False})
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200  # no delay then


async def test_delete_clears_every_fault(client: httpx.AsyncClient) -> None:
    """One call puts a node back to health, whatever faults it gained (the test stacks' reset
    named fields one by one and missed the newer ones, e.g. ``overload_delay_s``)."""
    clean = (await client.get("/sim/faults")).json()
    every = {"error_rate": 0.5, "error_status": 502, "hang": True, "drop_mid_stream": 0.5, "stall_mid_stream": 0.5,
             "fail_after_tokens": 3, "slowdown": 2.0, "overload": True, "retry_after_s": 2, "overload_delay_s": 0.1,
             "probe_loss": 0.5, "separator_tokens": True, "refuse_stream_options": True}
    assert set(every) | {"crash", "crash_for_s"} == set(clean)  # a new fault joins this test too
    assert (await client.post("/sim/faults", json=every)).json() != clean
    r = await client.delete("/sim/faults")
    assert r.status_code == 200 and r.json() == clean and (await client.get("/sim/faults")).json() == clean
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_error_rate_one_answers_500(client: httpx.AsyncClient) -> None:
    faults = (await client.post("/sim/faults", json={"error_rate": 1.0})).json()
    assert faults["error_rate"] == 1.0 and (await client.get("/sim/faults")).json() == faults
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    await client.post("/sim/faults", json={"error_status": 502, "retry_after_s": 4})
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.headers["retry-after"] == "4"
    assert (await client.post("/sim/faults", json={"error_rate": 3})).status_code == 400


async def test_hang_never_answers(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"hang": True})
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/chat/completions", json=CHAT, timeout=0.3)
    await client.post("/sim/faults", json={"hang": False})
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_drop_mid_stream_closes_after_the_first_token(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"drop_mid_stream": 1.0})
    got: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            async for line in r.aiter_lines():
                got.append(line)
    events = sse(got)
    assert events and "[DONE]" not in events
    assert "[h100-1]" in "".join(c["choices"][0]["delta"].get("content", "") for c in events)


async def test_probe_loss_drops_health_probes_only(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"probe_loss": 0.5})
    lost = 0
    for _ in range(40):
        try:
            assert (await client.get("/health")).status_code == 200
        except httpx.TransportError:
            lost += 1
    assert 8 <= lost <= 32  # seeded: about half, never all or none
    r = await client.post("/v1/chat/completions", json=CHAT)  # inference is untouched
    assert r.status_code == 200
    assert (await client.post("/sim/faults", json={"probe_loss": 1.5})).status_code == 400
    await client.post("/sim/faults", json={"probe_loss": 0.0})
    assert (await client.get("/health")).status_code == 200


async def test_vllm_overload_is_503_with_retry_after(node: SimNode, client: httpx.AsyncClient) -> None:
    r = await client.post("/sim/faults", json={"overload": True})
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == 503
    # A natural overload: the waiting queue beyond max_waiting.
    await client.post("/sim/faults", json={"overload": False})
    await client.post("/sim/profile", json={"max_concurrency": 1, "max_waiting": 1})
    long = {**CHAT, "max_tokens": 2000}
    first = asyncio.ensure_future(client.post("/v1/chat/completions", json=long))
    await eventually(lambda: _state_is(client, lambda s: s["batch"]["running"] == 1))
    second = asyncio.ensure_future(client.post("/v1/chat/completions", json=long))
    await eventually(lambda: _state_is(client, lambda s: s["queue"]["waiting"] == 1))
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


@pytest.mark.timeout(20)
async def test_crash_and_come_back(node: SimNode, client: httpx.AsyncClient) -> None:
    stream = asyncio.ensure_future(
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}))
    await eventually(lambda: _state_is(client, lambda s: s["batch"]["running"] == 1))
    r = await client.post("/sim/faults", json={"crash": {"for_s": 0.5}})
    assert r.status_code == 200 and r.json()["crash"] is True
    with pytest.raises(httpx.TransportError):
        await stream
    await eventually(lambda: refused(node.url))
    async with httpx.AsyncClient(base_url=node.url, timeout=2.0) as fresh:
        async def up() -> bool:
            try:
                return (await fresh.get("/health")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(up)
        assert (await fresh.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await fresh.get("/sim/faults")).json()["crash"] is False


# ----- fleet and CLI ---------------------------------------------------------------------------


def fleet_toml(ports: list[int], load_time_s: float = 0.0) -> str:
    engines = ["vllm", "sglang"]
    out = ""
    for i, port in enumerate(ports):
        out += textwrap.dedent(f"""
            [[nodes]]
            id = "sim-{i}"
            accelerator = "nvidia_h100"
            endpoint = "http://127.0.0.1:{port}"
            models = ["{M}"]
            [nodes.sim]
            engine = "{engines[i % 2]}"
            time_scale = 20.0
            load_time_s = {load_time_s}
            """)
    return out + textwrap.dedent("""
        [[nodes]]
        id = "real-0"
        accelerator = "nvidia_a100"
        endpoint = "http://127.0.0.1:1"
        """)


async def test_start_fleet_runs_sim_nodes_on_their_ports() -> None:
    ports = [free_port(), free_port()]
    cfg = parse_config(__import__("tomllib").loads(fleet_toml(ports)))
    nodes = await start_fleet(cfg.nodes)
    try:
        assert [n.port for n in nodes] == ports and [n.engine_kind for n in nodes] == ["vllm", "sglang"]
        async with httpx.AsyncClient() as c:
            for n in nodes:
                assert (await c.get(n.url + "/health")).status_code == 200
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))


async def run_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zml_sim", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.timeout(30)
async def test_cli_fleet_prints_ready_and_stops_on_sigterm(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    cfg = tmp_path / "zml.toml"
    cfg.write_text(fleet_toml(ports, load_time_s=4.0))  # 0.2 s at time_scale 20
    proc = await run_cli("--config", str(cfg))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert line.decode().strip() == "zml-sim ready 2 nodes"
        async with httpx.AsyncClient() as c:
            for port in ports:
                assert (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert b"Traceback" not in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.timeout(30)
async def test_cli_port_in_use_is_one_clear_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await run_cli("--accelerator", "nvidia_h100", "--port", str(port), "--node-id", "h100-9")
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "h100-9" in lines[0] and str(port) in lines[0]
    assert "Traceback" not in err.decode() and out == b""


@pytest.mark.timeout(30)
async def test_cli_single_node_serves() -> None:
    port = free_port()
    proc = await run_cli("--accelerator", "amd_mi300x", "--port", str(port), "--model", M,
                         "--time-scale", "50", "--load-time-s", "0", "--engine", "llamacpp")
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert line.decode().strip() == "zml-sim ready 1 nodes"
        async with httpx.AsyncClient() as c:
            probe = (await c.get(f"http://127.0.0.1:{port}/zml/v1/node")).json()
            assert probe["accelerator_type"] == "amd_mi300x" and probe["engine"] == "llamacpp"
            assert probe["driver_version"] == "6.0"
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
