"""Warmup's loader (issue 10 item 9): each engine's own way to load or wake a model, the
engine's name for the model (served_names), and never the simulator-only ``/sim/load``.

Against ``zml sim`` nodes imitating each engine, and a recording transport for the paths asked."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from test_health_helpers import start_sim
from zml_warmup import loader
from zml_warmup.planner import Load
from zml_warmup.service import WarmupService
from zmlcore.config import parse_config

M = "meta-llama/llama-3-8b-instruct"


class Recorder:
    """Answers like a production engine that has none of the load routes asked about."""

    def __init__(self, routes: dict[tuple[str, str], tuple[int, object]] | None = None) -> None:
        self.routes = routes or {}
        self.seen: list[tuple[str, str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.method, request.url.path, body))
        key = (request.method, request.url.path)
        if key in self.routes:
            status, payload = self.routes[key]
            return httpx.Response(status, json=payload)
        if key == ("POST", "/v1/chat/completions"):
            return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}]})
        return httpx.Response(404, json={"error": {"code": 404, "message": "File Not Found"}})


@pytest.mark.parametrize("backend", ["vllm", "tgi", "sglang", "llamacpp", "openai"])
async def test_production_nodes_never_get_sim_load_and_see_their_served_name(backend: str) -> None:
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        res = await loader.load(client, "http://node:8000", backend, M, served="llama-3-8b-q4.gguf")
    assert res.ok and res.done and res.mechanism == "warmup_request", res
    assert all(path != "/sim/load" for _, path, _ in rec.seen), rec.seen
    chat = [body for _, path, body in rec.seen if path == "/v1/chat/completions"]
    assert chat and chat[0]["model"] == "llama-3-8b-q4.gguf"  # type: ignore[index]


async def test_a_model_the_engine_does_not_serve_fails_with_a_reason() -> None:
    rec = Recorder({("POST", "/v1/chat/completions"): (404, {"error": {"message": "model not found"}})})
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        res = await loader.load(client, "http://node:8000", "tgi", M)
    assert not res.ok and "does not serve" in res.message


async def test_vllm_sim_asleep_is_woken_with_wake_up() -> None:
    sim = await start_sim("v1", "nvidia_h100", [M], engine="vllm", load_time_s=1.0, time_scale=10.0)
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.post(sim.url + "/sleep")).status_code == 200
            assert (await client.get(sim.url + "/is_sleeping")).json() == {"is_sleeping": True}
            assert (await client.get(sim.url + "/health")).status_code == 200  # vLLM stays healthy
            assert M not in sim.engine.models
            res = await loader.load(client, sim.url, "vllm", M)
            assert res.ok and res.done and res.mechanism == "vllm_wake_up", res
            assert (await client.get(sim.url + "/is_sleeping")).json() == {"is_sleeping": False}
            assert M in sim.engine.models  # /wake_up answered once the weights were back
            # awake: a warm-up request, not a second wake_up
            res = await loader.load(client, sim.url, "vllm", M)
            assert res.ok and res.mechanism == "warmup_request"
    finally:
        await sim.stop()


async def test_llamacpp_sim_loads_through_router_mode() -> None:
    sim = await start_sim("l1", "cpu", ["other"], engine="llamacpp", load_time_s=2.0, time_scale=10.0)
    try:
        await sim.engine.wait_loaded()
        async with httpx.AsyncClient() as client:
            res = await loader.load(client, sim.url, "llamacpp", M)
            assert res.ok and not res.done and res.mechanism == "llamacpp_load", res
            models = (await client.get(sim.url + "/models")).json()["data"]
            assert {m["id"]: m["status"]["value"] for m in models} == {"other": "loaded", M: "loading"}
            await sim.engine.wait_loaded(M)
            res = await loader.load(client, sim.url, "llamacpp", M)  # "model is already running"
            assert res.ok and res.done and res.mechanism == "llamacpp_load", res
    finally:
        await sim.stop()


async def test_llamacpp_router_mode_without_the_model_says_so() -> None:
    rec = Recorder({("POST", "/models/load"): (404, {"error": {"code": 404, "message": "model is not found",
                                                               "type": "not_found_error"}})})
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        res = await loader.load(client, "http://node:8000", "llamacpp", M, served="tiny")
    assert not res.ok and "router mode" in res.message and "'tiny'" in res.message
    assert rec.seen[0][2] == {"model": "tiny"}


def test_warmup_service_uses_the_nodes_served_name() -> None:
    cfg = parse_config({"nodes": [{"id": "n1", "accelerator": "cpu", "endpoint": "http://127.0.0.1:1",
                                   "backend": "llamacpp", "models": [M], "served_names": {M: "tiny.gguf"}},
                                  {"id": "n2", "accelerator": "cpu", "endpoint": "http://127.0.0.1:2",
                                   "backend": "llamacpp", "models": [M]}]}, "test")
    svc = WarmupService(cfg)
    assert svc._served(Load("n1", M)) == "tiny.gguf"
    assert svc._served(Load("n2", M)) is None


async def test_placement_unloads_through_each_engines_api() -> None:
    """The planner's unload: llama.cpp router mode's /models/unload (again: already gone, fine),
    vLLM's /sleep; an engine with no such API says so."""
    llama = await start_sim("u1", "cpu", [M], engine="llamacpp", load_time_s=0.1, time_scale=10.0)
    vllm = await start_sim("u2", "nvidia_h100", [M], engine="vllm", load_time_s=0.1, time_scale=10.0)
    try:
        await llama.engine.wait_loaded()
        await vllm.engine.wait_loaded()
        async with httpx.AsyncClient() as client:
            res = await loader.unload(client, llama.url, "llamacpp", M)
            assert res.ok and res.mechanism == "llamacpp_unload" and M not in llama.engine.models, res
            assert (await loader.unload(client, llama.url, "llamacpp", M)).ok  # "model is not running"
            assert (await client.get(llama.url + "/health")).status_code == 200  # an idle router is up
            res = await loader.unload(client, vllm.url, "vllm", M)
            assert res.ok and res.mechanism == "vllm_sleep" and M not in vllm.engine.models, res
            assert (await client.get(vllm.url + "/is_sleeping")).json() == {"is_sleeping": True}
            res = await loader.unload(client, vllm.url, "tgi", M)
            assert not res.ok and "no API to unload" in res.message
    finally:
        await llama.stop()
        await vllm.stop()


async def test_lora_adapters_load_and_unload_through_vllms_api() -> None:
    sim = await start_sim("a1", "nvidia_h100", [M], engine="vllm", load_time_s=0.1, time_scale=10.0)
    try:
        await sim.engine.wait_loaded()
        async with httpx.AsyncClient() as client:
            res = await loader.load_adapter(client, sim.url, "vllm", "tenant", "/adapters/tenant")
            assert res.ok and res.mechanism == "vllm_load_lora" and sim.adapters == {"tenant": "/adapters/tenant"}
            again = await loader.load_adapter(client, sim.url, "vllm", "tenant", "/adapters/tenant")
            assert again.ok  # "has already been loaded"
            listed = (await client.get(sim.url + "/v1/models")).json()["data"]
            assert {m["id"]: m["parent"] for m in listed} == {M: None, "tenant": M}
            body = {"model": "tenant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await client.post(sim.url + "/v1/chat/completions", json=body)).status_code == 200
            res = await loader.unload_adapter(client, sim.url, "vllm", "tenant")
            assert res.ok and sim.adapters == {}
            assert (await client.post(sim.url + "/v1/chat/completions", json=body)).status_code == 404
            assert (await loader.unload_adapter(client, sim.url, "vllm", "tenant")).ok  # 404: not loaded
            bad = await loader.load_adapter(client, sim.url, "openai", "tenant", "/x")
            assert not bad.ok and "no API to load a LoRA" in bad.message
    finally:
        await sim.stop()


async def test_lora_adapters_load_and_unload_through_sglangs_api() -> None:
    """SGLang's /load_lora_adapter and /unload_lora_adapter (--enable-lora): its reply is
    {"success", "error_message", "loaded_adapters"}, a request picks the adapter as
    "BASE:ADAPTER" and a bare adapter name runs the base model without it."""
    sim = await start_sim("s1", "nvidia_h100", [M], engine="sglang", load_time_s=0.1, time_scale=10.0)
    try:
        await sim.engine.wait_loaded()
        async with httpx.AsyncClient() as client:
            res = await loader.load_adapter(client, sim.url, "sglang", "tenant", "/adapters/tenant")
            assert res.ok and res.fresh and res.mechanism == "sglang_load_lora", res
            assert sim.adapters == {"tenant": "/adapters/tenant"}
            again = await loader.load_adapter(client, sim.url, "sglang", "tenant", "/adapters/tenant")
            assert again.ok and not again.fresh  # "already loaded": nothing loaded now
            listed = (await client.get(sim.url + "/v1/models")).json()["data"]
            assert {m["id"]: m["parent"] for m in listed} == {M: None, "tenant": M}
            body = {"model": f"{M}:tenant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert (await client.post(sim.url + "/v1/chat/completions", json=body)).status_code == 200
            bare = {**body, "model": "tenant"}
            assert (await client.post(sim.url + "/v1/chat/completions", json=bare)).status_code == 200
            assert sim.adapter_requests == {"tenant": 1}  # the bare name ran without the adapter
            res = await loader.unload_adapter(client, sim.url, "sglang", "tenant")
            assert res.ok and sim.adapters == {}
            gone = await loader.unload_adapter(client, sim.url, "sglang", "tenant")
            assert not gone.ok and "not loaded" in gone.message
    finally:
        await sim.stop()


async def test_tgi_adapters_are_launch_only_and_said_so() -> None:
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        res = await loader.load_adapter(client, "http://tgi:80", "tgi", "tenant", "/adapters/tenant")
        out = await loader.unload_adapter(client, "http://tgi:80", "tgi", "tenant")
    assert not res.ok and "only at launch (LORA_ADAPTERS)" in res.message
    assert not out.ok and "LORA_ADAPTERS" in out.message
    assert rec.seen == []  # no route asked: TGI has none


async def test_vllm_lora_resolver_loads_an_adapter_a_request_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's lora_filesystem_resolver, as the sim imitates it: DIR/NAME/adapter_config.json of a
    LoRA whose base the node serves is loaded (adapter_load_s) when a request names NAME."""
    (tmp_path / "tenant").mkdir()
    (tmp_path / "tenant" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": M}))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "base_model_name_or_path": "another/base"}))
    sim = await start_sim("r1", "nvidia_h100", [M], engine="vllm", time_scale=10.0,
                          lora_resolver_dir=str(tmp_path), adapter_load_s=2.0)
    try:
        await sim.engine.wait_loaded()
        async with httpx.AsyncClient() as client:
            body = {"model": "tenant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            t0 = time.monotonic()
            assert (await client.post(sim.url + "/v1/chat/completions", json=body)).status_code == 200
            assert time.monotonic() - t0 >= 0.2  # 2 s simulated at x10
            assert sim.adapters == {"tenant": str(tmp_path / "tenant")} and sim.adapter_requests == {"tenant": 1}
            for name in ("other", "missing"):  # another base's adapter, no such adapter: 404 as before
                r = await client.post(sim.url + "/v1/chat/completions", json={**body, "model": name})
                assert r.status_code == 404
    finally:
        await sim.stop()
