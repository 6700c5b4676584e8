"""llama.cpp server: ``/health``, ``/slots``, ``/v1/models``, ``/metrics``.

``/health`` answers 503 ``{"error": {"code": 503, "message": "Loading model", ...}}`` while the
model loads: "loading". ``/metrics`` exists only with ``--metrics`` (``llamacpp:requests_processing``,
``llamacpp:requests_deferred``, ``llamacpp:tokens_predicted_total``,
``llamacpp:kv_cache_usage_ratio``); without it the running count comes from ``/slots``
(``is_processing``), which also gives the capacity (one slot per parallel sequence).
"""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, error_message, failure, get_models
from zml_health.prometheus import parse_metrics


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        health = await client.get(endpoint + "/health", timeout=timeout)
        if health.status_code == 503:
            msg = error_message(health)
            return Probe(ok=False, loading="loading" in msg.lower(), error=msg or "/health answered 503")
        if health.status_code != 200:
            return Probe(ok=False, error=f"/health answered {health.status_code}")
        models = await get_models(client, endpoint, timeout)
        slots = await client.get(endpoint + "/slots", timeout=timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "llama.cpp probe")
    except ValueError as exc:
        return Probe(ok=False, error=f"/v1/models: bad JSON ({exc})")
    try:
        slot_list = slots.json() if slots.status_code == 200 else None
    except ValueError:
        slot_list = None
    m = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    return from_parts(models, slot_list if isinstance(slot_list, list) else None, m)


def from_parts(models: list[str], slots: list[object] | None, m: dict[str, float]) -> Probe:
    busy = sum(1 for s in slots or [] if isinstance(s, dict) and s.get("is_processing")) if slots is not None else 0
    running = int(m["llamacpp:requests_processing"]) if "llamacpp:requests_processing" in m else busy
    return Probe(
        ok=True,
        models=models,
        running=running,
        waiting=int(m.get("llamacpp:requests_deferred", 0)),
        kv_cache_usage=m.get("llamacpp:kv_cache_usage_ratio", 0.0),
        max_concurrency=len(slots) if slots else None,
        generation_tokens_total=m.get("llamacpp:tokens_predicted_total"),
    )
