"""Any OpenAI-compatible server: /v1/models is the only endpoint we can count on."""

from __future__ import annotations

import httpx

from zml_health.adapters.base import Probe, get_models


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float) -> Probe:
    try:
        models = await get_models(client, endpoint, timeout)
    except httpx.HTTPStatusError as exc:
        return Probe(ok=False, error=f"/v1/models answered {exc.response.status_code}")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Probe(ok=False, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    return Probe(ok=True, models=models)
