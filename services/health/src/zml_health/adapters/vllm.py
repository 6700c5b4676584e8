"""vLLM: ``/health``, ``/v1/models``, ``/metrics``.

Metrics read: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before v0.10),
``vllm:generation_tokens_total``, ``vllm:request_success_total`` and the
``vllm:time_to_first_token_seconds`` histogram (sum/count).

Prefix cache (V1 engine): ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens
looked up / found) and ``vllm:cache_config_info``, an info gauge whose labels are the cache
config (``block_size``, ``num_gpu_blocks``). Measured prefill speed counts only computed tokens:
``vllm:prompt_tokens`` less ``vllm:prompt_tokens_cached`` (0.11+; the hits counter before), since
cached tokens take no prefill time.

Sleep mode (``--enable-sleep-mode`` with ``VLLM_SERVER_DEV_MODE=1``): ``GET /is_sleeping``
(``{"is_sleeping": true}``) says the weights are offloaded; a server without it answers 404.
A sleeping vLLM still answers ``/health``; its models are not routable until ``POST /wake_up``
(warmup's job).

vLLM's API server refuses connections until its model is loaded, so a refused connection in the
start-up grace window means "loading" (decided by the tracker, which knows the window).
"""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, failure, first, get_models
from zml_health.prometheus import info_labels, parse_metrics


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        health = await client.get(endpoint + "/health", timeout=timeout)
        if health.status_code != 200:
            return Probe(ok=False, error=f"/health answered {health.status_code}")
        models = await get_models(client, endpoint, timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
        asleep = await client.get(endpoint + "/is_sleeping", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "vLLM probe")
    except ValueError as exc:
        return Probe(ok=False, error=f"/v1/models: bad JSON ({exc})")
    text = metrics.text if metrics.status_code == 200 else ""
    p = from_metrics(parse_metrics(text), models, info_labels(text, "vllm:cache_config_info"))
    p.sleeping = is_sleeping(asleep)
    return p


def is_sleeping(resp: httpx.Response) -> bool:
    """``GET /is_sleeping``: 404 on a server without sleep mode (awake, then)."""
    if resp.status_code != 200:
        return False
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("is_sleeping") is True


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        value = int(labels.get(key, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def from_metrics(m: dict[str, float], models: list[str], cache_config: dict[str, str] | None = None) -> Probe:
    cc = cache_config or {}
    prompt = m.get("vllm:prompt_tokens_total")
    cached = first(m, "vllm:prompt_tokens_cached_total", "vllm:prefix_cache_hits_total")
    return Probe(
        ok=True,
        models=models,
        running=int(m.get("vllm:num_requests_running", 0)),
        waiting=int(m.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage=first(m, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") or 0.0,
        generation_tokens_total=m.get("vllm:generation_tokens_total"),
        requests_ok_total=m.get("vllm:request_success_total"),
        ttft_sum=m.get("vllm:time_to_first_token_seconds_sum"),
        ttft_count=m.get("vllm:time_to_first_token_seconds_count"),
        prompt_tokens_total=prompt - cached if prompt is not None and cached is not None else prompt,
        prefill_time_sum=m.get("vllm:request_prefill_time_seconds_sum"),
        decode_time_sum=m.get("vllm:request_decode_time_seconds_sum"),
        request_gen_tokens_sum=m.get("vllm:request_generation_tokens_sum"),
        request_gen_tokens_count=m.get("vllm:request_generation_tokens_count"),
        prefix_queries_total=m.get("vllm:prefix_cache_queries_total"),
        prefix_hits_total=m.get("vllm:prefix_cache_hits_total"),
        kv_block_size=_int_label(cc, "block_size"),
        kv_cache_blocks=_int_label(cc, "num_gpu_blocks"),
    )
