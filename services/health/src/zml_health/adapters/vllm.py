"""vLLM: /health, /v1/models, /metrics (vllm:num_requests_running|waiting, kv cache usage).

vLLM refuses connections until its model is loaded, so a refused connection during the
start-up grace window means "loading" (decided by the tracker, not here).
"""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, get_models
from zml_health.prometheus import parse_metrics


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float) -> Probe:
    try:
        health = await client.get(endpoint + "/health", timeout=timeout)
        if health.status_code != 200:
            return Probe(ok=False, error=f"/health answered {health.status_code}")
        models = await get_models(client, endpoint, timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        return Probe(ok=False, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    m = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    kv = m.get("vllm:kv_cache_usage_perc", m.get("vllm:gpu_cache_usage_perc", 0.0))
    return Probe(
        ok=True,
        models=models,
        running=int(m.get("vllm:num_requests_running", 0)),
        waiting=int(m.get("vllm:num_requests_waiting", 0)),
        kv_cache_usage=kv,
        generation_tokens_total=m.get("vllm:generation_tokens_total"),
    )
