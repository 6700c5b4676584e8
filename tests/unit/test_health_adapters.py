"""Each engine adapter against recorded responses (tests/data/engines), over httpx's mock transport."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from zml_health.adapters import adapter_for, sglang

DATA = Path(__file__).resolve().parents[1] / "data" / "engines"
BASE = "http://node:8000"


def answer(routes: dict[str, tuple[int, str]], request: httpx.Request) -> httpx.Response:
    if request.url.path not in routes:
        return httpx.Response(404, json={"detail": "Not Found"})
    status, name = routes[request.url.path]
    body = (DATA / name).read_bytes() if name else b""
    return httpx.Response(status, content=body)


def recorded(routes: dict[str, tuple[int, str]]) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: answer(routes, request)))


def refusing() -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def timing_out() -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


async def probe(backend: str, client: httpx.AsyncClient, poll: int = 0):  # type: ignore[no-untyped-def]
    async with client:
        return await adapter_for(backend)(client, BASE, 1.0, poll)


async def test_vllm_reads_queue_cache_counters_and_ttft() -> None:
    p = await probe("vllm", recorded({"/health": (200, ""), "/v1/models": (200, "vllm/models.json"),
                                      "/metrics": (200, "vllm/metrics.txt")}))
    assert p.ok and p.models == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert (p.running, p.waiting, p.kv_cache_usage) == (7, 3, 0.4213)
    assert p.generation_tokens_total == 51234.0 and p.requests_ok_total == 250.0
    assert (p.ttft_sum, p.ttft_count) == (37.5, 250.0)


async def test_vllm_older_releases_name_the_cache_gauge_gpu_cache_usage_perc() -> None:
    p = await probe("vllm", recorded({"/health": (200, ""), "/v1/models": (200, "vllm/models.json"),
                                      "/metrics": (200, "vllm-0.6/metrics.txt")}))
    assert p.ok and p.kv_cache_usage == 0.125 and p.running == 2


@pytest.mark.parametrize("backend", ["vllm", "tgi", "sglang", "llamacpp", "openai"])
async def test_refused_connection_is_a_failure_not_a_loading_claim(backend: str) -> None:
    # vLLM/TGI refuse connections while loading: only the tracker, which knows the start-up
    # grace window, may call that "loading".
    p = await probe(backend, refusing())
    assert not p.ok and not p.loading and not p.slow and "ConnectError" in p.error


@pytest.mark.parametrize("backend", ["vllm", "tgi", "sglang", "llamacpp", "openai"])
async def test_timeout_is_slow(backend: str) -> None:
    p = await probe(backend, timing_out())
    assert not p.ok and p.slow


async def test_tgi_reads_info_and_metrics() -> None:
    p = await probe("tgi", recorded({"/health": (200, ""), "/info": (200, "tgi/info.json"),
                                     "/metrics": (200, "tgi/metrics.txt")}))
    assert p.ok and p.models == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert (p.running, p.waiting, p.max_concurrency) == (12, 5, 128)
    assert p.generation_tokens_total == 143212  # the histogram's _sum, not its request _count
    assert (p.requests_ok_total, p.requests_failed_total) == (1020, 5)


async def test_sglang_cheap_poll_and_rare_generate_probe() -> None:
    routes = {"/ready": (200, ""), "/v1/models": (200, "sglang/models.json"),
              "/metrics": (200, "sglang/metrics.txt"), "/health_generate": (503, "")}
    p = await probe("sglang", recorded(routes), poll=0)
    assert p.ok and (p.running, p.waiting, p.kv_cache_usage) == (24, 9, 0.68)
    assert p.requests_ok_total == 512.0
    # every GENERATE_EVERY-th poll runs /health_generate, which fails here
    p = await probe("sglang", recorded(routes), poll=sglang.GENERATE_EVERY - 1)
    assert not p.ok and "/health_generate" in p.error


async def test_sglang_503_is_loading() -> None:
    p = await probe("sglang", recorded({"/ready": (503, "")}))
    assert not p.ok and p.loading


async def test_llamacpp_loading_model_503() -> None:
    p = await probe("llamacpp", recorded({"/health": (503, "llamacpp/health_loading.json")}))
    assert not p.ok and p.loading and p.error == "Loading model"


def never_slots(routes: dict[str, tuple[int, str]]) -> httpx.AsyncClient:
    """Recorded answers; GET /slots fails the test (it wakes a sleeping llama-server)."""
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path != "/slots", "the llama.cpp adapter must not poll /slots"
        return answer(routes, request)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def sample(text: str, name: str) -> float:
    """One unlabelled sample of the recorded exposition (read independently of the adapter)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} missing from the recording"
    return float(found[1])


LLAMACPP_LIVE = {"/health": (200, "llamacpp/health_ok.json"), "/v1/models": (200, "llamacpp/models.json"),
                 "/props": (200, "llamacpp/props.json"), "/slots": (200, "llamacpp/slots.json"),
                 "/metrics": (200, "llamacpp/metrics.txt")}


async def test_llamacpp_reads_real_metric_names_and_props_never_slots() -> None:
    p = await probe("llamacpp", never_slots(LLAMACPP_LIVE))
    m = (DATA / "llamacpp" / "metrics.txt").read_text()
    props = json.loads((DATA / "llamacpp" / "props.json").read_text())
    assert p.ok and p.models == [props["model_alias"]] and not p.sleeping
    assert p.max_concurrency == props["total_slots"] == 4
    assert p.running == sample(m, "llamacpp:requests_processing")
    assert p.waiting == sample(m, "llamacpp:requests_deferred")
    assert p.generation_tokens_total == sample(m, "llamacpp:tokens_predicted_total") > 0
    assert p.prompt_tokens_total == sample(m, "llamacpp:prompt_tokens_total") > 0
    assert p.prefill_time_sum == sample(m, "llamacpp:prompt_seconds_total") > 0
    assert p.decode_time_sum == sample(m, "llamacpp:tokens_predicted_seconds_total") > 0
    steps = sample(m, "llamacpp:n_decode_total")
    assert p.decode_steps_total == steps > 0
    assert p.busy_slot_steps_total == pytest.approx(sample(m, "llamacpp:n_busy_slots_per_decode") * steps)
    # real llama-server has no KV-cache gauge (the invented fixture had one)
    assert "kv_cache" not in m and p.kv_cache_usage == 0.0


async def test_llamacpp_sleeping_server_is_up_and_asleep() -> None:
    routes = {**LLAMACPP_LIVE, "/props": (200, "llamacpp/props_sleeping.json"),
              "/metrics": (200, "llamacpp/metrics_sleeping.txt")}
    p = await probe("llamacpp", never_slots(routes))
    assert p.ok and p.sleeping and p.max_concurrency == 4


async def test_llamacpp_speeds_from_two_recordings() -> None:
    """The recorded server's own counters give its speeds: zero at start, then the recording."""
    from zml_health.speed import Readings, SpeedMeter

    p = await probe("llamacpp", never_slots(LLAMACPP_LIVE))
    meter = SpeedMeter()
    meter.observe(Readings(0, 0.0, 0, 0, 0.0, 0, 0), running=0)
    meter.observe(Readings(p.prompt_tokens_total, p.prefill_time_sum, p.request_gen_tokens_sum,  # type: ignore[arg-type]
                           p.request_gen_tokens_count, p.decode_time_sum, p.decode_steps_total,
                           p.busy_slot_steps_total), running=p.running)
    assert meter.prefill_tps and meter.decode_tps
    m = (DATA / "llamacpp" / "metrics.txt").read_text()
    assert meter.prefill_tps == pytest.approx(sample(m, "llamacpp:prompt_tokens_total")
                                              / sample(m, "llamacpp:prompt_seconds_total"))


async def test_llamacpp_without_metrics_flag_is_up_without_queue_counts() -> None:
    p = await probe("llamacpp", never_slots({**LLAMACPP_LIVE, "/metrics": (501, "")}))
    assert p.ok and (p.running, p.waiting) == (0, 0) and p.prompt_tokens_total is None
    assert p.max_concurrency == 4


def test_llamacpp_router_mode_lists_loaded_and_loading_models() -> None:
    from zml_health.adapters.llamacpp import router_models

    listing = {"data": [{"id": "a", "status": {"value": "loaded"}}, {"id": "b", "status": {"value": "loading"}},
                        {"id": "c", "status": {"value": "unloaded"}}, {"id": "d", "status": {"value": "sleeping"}},
                        {"id": "single-model-server"}]}
    assert router_models(listing) == (["a", "d", "single-model-server"], ["b"])


async def test_openai_fallback_lists_models() -> None:
    p = await probe("openai", recorded({"/v1/models": (200, "vllm/models.json")}))
    assert p.ok and p.models == ["meta-llama/Llama-3.1-8B-Instruct"] and p.running == 0


def test_unknown_backend_falls_back_to_openai() -> None:
    assert adapter_for("triton") is adapter_for("openai")




def test_llamacpp_router_mode_lists_each_models_lora_files_from_its_launch_arguments() -> None:
    """llama-server's router mode lists every model with the arguments its instance runs with
    (a --models-preset section's ``lora = a,b`` becomes ``--lora a,b``): its adapters, ids in
    that order, per model, loaded or not; /lora-adapters would need ?model= per model."""
    from zml_health.adapters.llamacpp import launch_loras

    listing = {"data": [
        {"id": "tiny", "status": {"value": "loaded", "args": ["llama-server", "--lora", "/l/p.gguf,/l/q.gguf",
                                                              "--alias", "tiny", "--model", "/m/tiny.gguf"]}},
        {"id": "other", "status": {"value": "unloaded", "args": ["llama-server", "--model", "/m/other.gguf"]}}]}
    assert launch_loras(listing) == {"tiny": ["/l/p.gguf", "/l/q.gguf"], "other": []}
    assert launch_loras({"data": [{"id": "single-model-server"}]}) is None
    # a listing without launch arguments (zml sim's): /lora-adapters says, as for one model
    assert launch_loras({"data": [{"id": "tiny", "status": {"value": "loaded"}}]}) is None
