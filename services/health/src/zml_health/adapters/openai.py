"""Any OpenAI-compatible server: ``/v1/models`` is the only endpoint we can count on.

A 503 there is read as "loading" (many servers answer it while starting)."""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, failure, model_ids


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        resp = await client.get(endpoint + "/v1/models", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "/v1/models")
    if resp.status_code != 200:
        return Probe(ok=False, loading=resp.status_code == 503, error=f"/v1/models answered {resp.status_code}")
    try:
        models = model_ids(resp.json())
    except ValueError as exc:
        return Probe(ok=False, error=f"/v1/models: bad JSON ({exc})")
    return Probe(ok=True, models=models)
