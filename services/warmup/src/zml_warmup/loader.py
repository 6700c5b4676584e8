"""Asking a node to load (or wake) a model, through its engine's own mechanism.

* vLLM: sleep mode (``GET /is_sleeping`` -> ``POST /wake_up``, which returns once the weights
  are back; needs ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``). vLLM cannot load a
  model it was not started with, so an awake vLLM gets a warm-up request.
* llama.cpp: router mode (llama-server started without ``--model``, with ``--models-dir`` or
  ``--models-preset``) loads on ``POST /models/load {"model": ...}`` (400 "already running" when
  it is). A single-model server has no such route (404): a warm-up request, which also wakes a
  server sleeping after ``--sleep-idle-seconds``.
* Any other engine: a one-token warm-up request (warms caches and graphs; a node that does not
  serve the model answers 404, reported as such).

Requests carry the engine's name for the model (the node's ``served_names``), never ZML's.
``zml sim`` imitates each engine's mechanism; its own ``/sim/load`` is never sent here.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from zmlcore.messages.node import LORA_ALL_OFF

WARMUP_BODY = {"messages": [{"role": "user", "content": "warmup"}], "max_tokens": 1, "temperature": 0}


@dataclass(frozen=True, slots=True)
class LoadResult:
    #: True: the node accepted (loading or already loaded); False: it cannot load the model.
    ok: bool
    mechanism: str
    message: str = ""
    #: The load finished within the call (warm-up request, or the model was already there).
    done: bool = False
    #: The engine loaded it in this call (not found loaded): the call's time is its load time.
    fresh: bool = False


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
               served: str | None = None, timeout: float = 10.0, api_key: str | None = None,
               lora_off: bool = False) -> LoadResult:
    """Load ``model`` (ZML's name; ``served`` is the engine's, when it differs) on a node.
    ``lora_off``: see :func:`warmup_request`."""
    base = endpoint.rstrip("/")
    name = served or model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if backend == "vllm":
            r = await client.get(base + "/is_sleeping", timeout=timeout, headers=headers)
            if r.status_code == 200 and isinstance(r.json(), dict) and r.json().get("is_sleeping") is True:
                w = await client.post(base + "/wake_up", timeout=timeout, headers=headers)
                if w.status_code == 200:
                    return LoadResult(True, "vllm_wake_up", done=True)
                return LoadResult(False, "vllm_wake_up", f"/wake_up answered {w.status_code}: {_detail(w)}")
        elif backend == "llamacpp":
            r = await client.post(base + "/models/load", json={"model": name}, timeout=timeout, headers=headers)
            if r.status_code == 200:
                return LoadResult(True, "llamacpp_load")
            if r.status_code == 400 and "already running" in _detail(r):
                return LoadResult(True, "llamacpp_load", done=True)
            if r.status_code not in (404, 405):  # 404: not router mode (or an unknown model, below)
                return LoadResult(False, "llamacpp_load", f"/models/load answered {r.status_code}: {_detail(r)}")
            if r.status_code == 404 and "model is not found" in _detail(r):
                return LoadResult(False, "llamacpp_load", f"llama-server (router mode) has no model {name!r} "
                                  "in its --models-dir / --models-preset")
        return await warmup_request(client, base, name, timeout=timeout, headers=headers, lora_off=lora_off)
    except httpx.HTTPError as exc:
        return LoadResult(False, "", f"{type(exc).__name__}: {exc}")
    except ValueError as exc:
        return LoadResult(False, "", f"bad JSON from the node: {exc}")


async def warmup_request(client: httpx.AsyncClient, base: str, model: str, *, timeout: float,
                         headers: dict[str, str] | None = None, lora_off: bool = False) -> LoadResult:
    """A one-token completion straight to the node (not through a router). ``model`` is the
    engine's name for it. ``lora_off``: a llama-server holding --lora adapters is asked with
    every adapter off, as routers ask it for a base model (without a ``lora`` list it would run
    at the global scales and leave a slot's prompt cache labelled with them whatever made it)."""
    body = {"model": model, **WARMUP_BODY}
    if lora_off:
        body["lora"] = list(LORA_ALL_OFF)
    r = await client.post(base + "/v1/chat/completions", json=body, timeout=timeout, headers=headers or {})
    if r.status_code == 200:
        return LoadResult(True, "warmup_request", done=True)
    if r.status_code == 404:
        return LoadResult(False, "warmup_request",
                          f"the engine does not serve {model!r} and has no load endpoint: start it with "
                          "the model (or use vLLM sleep mode / llama.cpp router mode)")
    return LoadResult(False, "warmup_request", f"warm-up request answered {r.status_code}: {_detail(r)}")


async def unload(client: httpx.AsyncClient, endpoint: str, backend: str, model: str, *,
                 served: str | None = None, timeout: float = 30.0, api_key: str | None = None) -> LoadResult:
    """Unload ``model`` from a node through its engine's own API.

    * llama.cpp router mode: ``POST /models/unload {"model"}`` (400 "not running": already gone).
    * vLLM: an engine holds the model it was started with; ``POST /sleep`` frees its memory
      (the planner's "idle" for a vLLM node), ``/wake_up`` brings it back.
    * Others (SGLang, TGI, any OpenAI server): no API unloads a model; said as a failure.
    """
    base = endpoint.rstrip("/")
    name = served or model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if backend == "llamacpp":
            r = await client.post(base + "/models/unload", json={"model": name}, timeout=timeout, headers=headers)
            if r.status_code == 200 or (r.status_code == 400 and "not running" in _detail(r)):
                return LoadResult(True, "llamacpp_unload", done=True)
            return LoadResult(False, "llamacpp_unload", f"/models/unload answered {r.status_code}: {_detail(r)}")
        if backend == "vllm":
            r = await client.post(base + "/sleep", timeout=timeout, headers=headers)
            if r.status_code == 200:
                return LoadResult(True, "vllm_sleep", done=True)
            return LoadResult(False, "vllm_sleep", f"/sleep answered {r.status_code}: {_detail(r)} (vLLM needs "
                              "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1)")
    except httpx.HTTPError as exc:
        return LoadResult(False, "", f"{type(exc).__name__}: {exc}")
    return LoadResult(False, "", f"a {backend} engine has no API to unload a model: restart it without {name!r}")


async def load_adapter(client: httpx.AsyncClient, endpoint: str, backend: str, adapter: str, path: str, *,
                       timeout: float = 60.0, api_key: str | None = None) -> LoadResult:
    """Load a LoRA adapter: vLLM ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``
    (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), SGLang ``POST /load_lora_adapter`` with the
    same body (needs ``--enable-lora``; its reply ``{"success", "error_message",
    "loaded_adapters"}``, 400 when not a success). llama.cpp loads adapters only at start
    (``--lora``): one it holds already is reported loaded, another cannot be. TGI loads them only
    at launch (``LORA_ADAPTERS``): said so, as a failed load."""
    base = endpoint.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if backend in ("vllm", "sglang"):
            route, mech = ("/v1/load_lora_adapter", "vllm_load_lora") if backend == "vllm" else \
                ("/load_lora_adapter", "sglang_load_lora")
            r = await client.post(base + route, json={"lora_name": adapter, "lora_path": path},
                                  timeout=timeout, headers=headers)
            if r.status_code == 200:
                return LoadResult(True, mech, done=True, fresh=True)
            if r.status_code == 400 and "already" in _detail(r):
                return LoadResult(True, mech, done=True)
            return LoadResult(False, mech, f"{route} answered {r.status_code}: {_detail(r)}")
        if backend == "llamacpp":
            held = await llamacpp_adapters(client, base, headers=headers, timeout=timeout)
            if path in held.values() or adapter in held.values():
                return LoadResult(True, "llamacpp_lora", done=True)
            return LoadResult(False, "llamacpp_lora", f"llama-server loads adapters only at start: add --lora {path}")
        if backend == "tgi":
            return LoadResult(False, "tgi_lora", "TGI loads LoRA adapters only at launch (LORA_ADAPTERS): "
                              f"relaunch it with {path or adapter}")
    except httpx.HTTPError as exc:
        return LoadResult(False, "", f"{type(exc).__name__}: {exc}")
    except ValueError as exc:
        return LoadResult(False, "", f"bad JSON from the node: {exc}")
    return LoadResult(False, "", f"a {backend} engine has no API to load a LoRA adapter")


async def unload_adapter(client: httpx.AsyncClient, endpoint: str, backend: str, adapter: str, *,
                         timeout: float = 30.0, api_key: str | None = None) -> LoadResult:
    """vLLM ``POST /v1/unload_lora_adapter {"lora_name"}``, SGLang ``POST /unload_lora_adapter``
    (same body); llama.cpp keeps its start-up adapters (requests name the one they use), so
    there is nothing to unload; TGI keeps those it was launched with."""
    base = endpoint.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if backend in ("vllm", "sglang"):
            route, mech = ("/v1/unload_lora_adapter", "vllm_unload_lora") if backend == "vllm" else \
                ("/unload_lora_adapter", "sglang_unload_lora")
            r = await client.post(base + route, json={"lora_name": adapter}, timeout=timeout, headers=headers)
            if r.status_code == 200 or (r.status_code == 404 and backend == "vllm"):  # vLLM's 404: not loaded
                return LoadResult(True, mech, done=True)
            return LoadResult(False, mech, f"{route} answered {r.status_code}: {_detail(r)}")
        if backend == "llamacpp":
            return LoadResult(True, "llamacpp_lora", "llama-server keeps its --lora adapters", done=True)
        if backend == "tgi":
            return LoadResult(False, "tgi_lora", "TGI keeps the LoRA adapters it was launched with (LORA_ADAPTERS)")
    except httpx.HTTPError as exc:
        return LoadResult(False, "", f"{type(exc).__name__}: {exc}")
    return LoadResult(False, "", f"a {backend} engine has no API to unload a LoRA adapter")


async def llamacpp_adapters(client: httpx.AsyncClient, base: str, *, headers: dict[str, str] | None = None,
                            timeout: float = 10.0) -> dict[int, str]:
    """llama-server's ``GET /lora-adapters``: id -> path of each adapter it was started with."""
    r = await client.get(base + "/lora-adapters", timeout=timeout, headers=headers or {})
    r.raise_for_status()
    body = r.json()
    return {int(a["id"]): str(a.get("path", "")) for a in body if isinstance(a, dict) and "id" in a}
