"""Asking a node to load a model, through the engine's own mechanism where there is one.

In order: vLLM sleep mode (``GET /is_sleeping`` -> ``POST /wake_up``; needs the server started
with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``), ``zml sim``'s ``POST /sim/load``,
else a one-token warm-up request (which warms caches and graphs on engines that serve the model
but cannot load one on demand).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

WARMUP_BODY = {"messages": [{"role": "user", "content": "warmup"}], "max_tokens": 1, "temperature": 0}


@dataclass(frozen=True, slots=True)
class LoadResult:
    #: True: the node accepted (loading or already loaded); False: it cannot load the model.
    ok: bool
    mechanism: str
    message: str = ""
    #: The load finished within the call (warm-up request, or the model was already there).
    done: bool = False


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", ""))
    return str(err or body)[:200]


async def load(client: httpx.AsyncClient, endpoint: str, backend: str, model: str, *,
               timeout: float = 10.0, api_key: str | None = None) -> LoadResult:
    base = endpoint.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if backend == "vllm":
            r = await client.get(base + "/is_sleeping", timeout=timeout, headers=headers)
            if r.status_code == 200 and isinstance(r.json(), dict) and r.json().get("is_sleeping"):
                w = await client.post(base + "/wake_up", timeout=timeout, headers=headers)
                if w.status_code == 200:
                    return LoadResult(True, "vllm_wake_up")
                return LoadResult(False, "vllm_wake_up", f"/wake_up answered {w.status_code}: {_detail(w)}")
        r = await client.post(base + "/sim/load", json={"model": model}, timeout=timeout)
        if r.status_code in (200, 202):
            state = r.json().get("state") if isinstance(r.json(), dict) else None
            return LoadResult(True, "sim_load", done=state == "loaded")
        if r.status_code not in (404, 405):
            return LoadResult(False, "sim_load", f"/sim/load answered {r.status_code}: {_detail(r)}")
        return await warmup_request(client, base, model, timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        return LoadResult(False, "", f"{type(exc).__name__}: {exc}")
    except ValueError as exc:
        return LoadResult(False, "", f"bad JSON from the node: {exc}")


async def warmup_request(client: httpx.AsyncClient, base: str, model: str, *, timeout: float,
                         headers: dict[str, str] | None = None) -> LoadResult:
    """A one-token completion straight to the node (not through a router)."""
    r = await client.post(base + "/v1/chat/completions", json={"model": model, **WARMUP_BODY},
                          timeout=timeout, headers=headers or {})
    if r.status_code == 200:
        return LoadResult(True, "warmup_request", done=True)
    if r.status_code == 404:
        return LoadResult(False, "warmup_request",
                          f"the engine does not serve {model!r} and has no load endpoint: start it with "
                          "the model, or use vLLM sleep mode")
    return LoadResult(False, "warmup_request", f"warm-up request answered {r.status_code}: {_detail(r)}")
