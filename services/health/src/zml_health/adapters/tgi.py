"""Hugging Face TGI: ``/health``, ``/info``, ``/metrics``.

``/info`` names the one model (``model_id``) and the capacity (``max_concurrent_requests``).
Metrics read: ``tgi_queue_size`` (waiting), ``tgi_batch_current_size`` (running),
``tgi_request_success`` / ``tgi_request_failure`` (counters) and ``tgi_request_generated_tokens``
(a histogram of tokens per request: its ``_sum`` is the token counter).

TGI's router does not listen until the model is loaded: refused connections during the
start-up grace window mean "loading".
"""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, failure, first
from zml_health.prometheus import parse_metrics


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        health = await client.get(endpoint + "/health", timeout=timeout)
        if health.status_code != 200:
            return Probe(ok=False, error=f"/health answered {health.status_code}")
        info = await client.get(endpoint + "/info", timeout=timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "TGI probe")
    try:
        body = info.json() if info.status_code == 200 else {}
    except ValueError:
        body = {}
    m = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    return from_parts(body if isinstance(body, dict) else {}, m)


def from_parts(info: dict[str, object], m: dict[str, float]) -> Probe:
    model = info.get("model_id")
    cap = info.get("max_concurrent_requests")
    return Probe(
        ok=True,
        models=[model] if isinstance(model, str) and model else [],
        running=int(m.get("tgi_batch_current_size", 0)),
        waiting=int(m.get("tgi_queue_size", 0)),
        max_concurrency=cap if isinstance(cap, int) and cap > 0 else None,
        # tgi_request_generated_tokens is a histogram of tokens per request: _sum is the total.
        # (The sim exposes tgi_request_generated_tokens_count as a token counter: fallback.)
        generation_tokens_total=first(m, "tgi_request_generated_tokens_sum", "tgi_request_generated_tokens_count"),
        requests_ok_total=m.get("tgi_request_success"),
        requests_failed_total=m.get("tgi_request_failure"),
    )
