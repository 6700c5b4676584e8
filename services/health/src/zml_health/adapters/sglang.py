"""SGLang: ``/ready`` for cheap polls (``/health`` on releases without it), ``/health_generate``
every Nth poll (it runs a one-token generation through the scheduler), ``/v1/models``, ``/metrics``.

Metrics read: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:generation_tokens_total``, ``sglang:num_requests_total`` and the
``sglang:time_to_first_token_seconds`` histogram.

SGLang listens at once and answers 503 until the model is loaded and warm: "loading".
"""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, failure, get_models
from zml_health.prometheus import parse_metrics

#: Poll ``/health_generate`` every this many polls (set from [health] generate_probe_every).
GENERATE_EVERY = 12


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        ready = await client.get(endpoint + "/ready", timeout=timeout)
        if ready.status_code == 404:  # older SGLang: /health only
            ready = await client.get(endpoint + "/health", timeout=timeout)
        if ready.status_code == 503:
            return Probe(ok=False, loading=True, error="SGLang is loading (503)")
        if ready.status_code != 200:
            return Probe(ok=False, error=f"/ready answered {ready.status_code}")
        if poll % GENERATE_EVERY == GENERATE_EVERY - 1:
            gen = await client.get(endpoint + "/health_generate", timeout=timeout * 5)
            if gen.status_code != 200:
                return Probe(ok=False, error=f"/health_generate answered {gen.status_code}")
        models = await get_models(client, endpoint, timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "SGLang probe")
    except ValueError as exc:
        return Probe(ok=False, error=f"/v1/models: bad JSON ({exc})")
    m = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    return from_metrics(m, models)


def from_metrics(m: dict[str, float], models: list[str]) -> Probe:
    return Probe(
        ok=True,
        models=models,
        running=int(m.get("sglang:num_running_reqs", 0)),
        waiting=int(m.get("sglang:num_queue_reqs", 0)),
        kv_cache_usage=m.get("sglang:token_usage", 0.0),
        generation_tokens_total=m.get("sglang:generation_tokens_total"),
        requests_ok_total=m.get("sglang:num_requests_total"),
        ttft_sum=m.get("sglang:time_to_first_token_seconds_sum"),
        ttft_count=m.get("sglang:time_to_first_token_seconds_count"),
    )
