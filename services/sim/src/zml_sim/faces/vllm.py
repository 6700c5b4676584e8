"""vLLM's OpenAI server: ``/version``, ``/ping``, and sleep mode (a real server needs
``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep`` offloads the weights
(the models stay listed, ``/health`` stays 200, requests fail), ``GET /is_sleeping`` ->
``{"is_sleeping": bool}``, ``POST /wake_up`` reloads them (the load time applies) and answers
once they are back. Runtime LoRA (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``POST
/v1/load_lora_adapter {"lora_name", "lora_path"}`` (400 when already loaded),
``POST /v1/unload_lora_adapter {"lora_name"}`` (404 when not loaded); a loaded adapter is a
``model`` requests may name, listed in ``/v1/models`` with the served model as its ``parent``.
With ``[nodes.sim] lora_resolver_dir`` a request naming an adapter found there is loaded first,
as vLLM's ``lora_filesystem_resolver`` plugin does (zml_sim.inference).
``POST /reset_prefix_cache`` (dev mode) empties the prefix cache (an
``AllBlocksCleared`` KV event); refused while requests run, as vLLM refuses it."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from aiohttp import web

from zml_sim.engine import SimError
from zml_sim.faces.base import Face
from zml_sim.faces.base import json_response
from zml_sim.nodeview import NodeView


class VLLM(Face):
    name = "vllm"

    def continues(self, body: dict[str, Any]) -> bool:
        # vLLM's own check (its add_generation_prompt defaults to true).
        if body.get("continue_final_message") is True and body.get("add_generation_prompt", True) is not False:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return super().continues(body)

    def add_routes(self, node: NodeView, r: web.UrlDispatcher) -> None:
        r.add_get("/version", _version)
        r.add_get("/ping", node.health)
        r.add_get("/is_sleeping", partial(_is_sleeping, node))
        r.add_post("/sleep", partial(_sleep, node))
        r.add_post("/wake_up", partial(_wake_up, node))
        r.add_post("/reset_prefix_cache", partial(_reset_prefix_cache, node))
        r.add_post("/v1/load_lora_adapter", partial(_load_lora, node))
        r.add_post("/v1/unload_lora_adapter", partial(_unload_lora, node))


FACE = VLLM()


async def _version(req: web.Request) -> web.Response:
    return json_response({"version": "0.8.5"})


async def _is_sleeping(node: NodeView, req: web.Request) -> web.Response:
    return json_response({"is_sleeping": bool(node.sleeping)})


async def _sleep(node: NodeView, req: web.Request) -> web.Response:
    eng = node.engine
    for model in list(eng.models):
        node.sleeping.append(model)
        eng.unload(model)
    return web.Response(status=200)


async def _wake_up(node: NodeView, req: web.Request) -> web.Response:
    eng = node.engine
    models, node.sleeping = list(node.sleeping), []
    try:
        for model in models:
            eng.load(model)
        await asyncio.gather(*(eng.wait_loaded(m) for m in models))
    except SimError as exc:
        return node.error(500, str(exc), "internal")
    return web.Response(status=200)


async def _reset_prefix_cache(node: NodeView, req: web.Request) -> web.Response:
    if not node.engine.reset_prefix_cache():
        return node.error(400, "Failed to reset the prefix cache: requests are running", "bad_request")
    return web.Response(status=200)


async def _lora_body(node: NodeView, req: web.Request) -> dict[str, Any] | web.Response:
    try:
        body = await req.json()
    except ValueError:
        return node.error(400, "Invalid JSON", "bad_request")
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
        return node.error(400, "Both 'lora_name' and 'lora_path' must be provided.", "bad_request")
    return body


async def _load_lora(node: NodeView, req: web.Request) -> web.Response:
    body = await _lora_body(node, req)
    if isinstance(body, web.Response):
        return body
    name, path = body["lora_name"], body.get("lora_path")
    if not isinstance(path, str) or not path:
        return node.error(400, "Both 'lora_name' and 'lora_path' must be provided.", "bad_request")
    if name in node.adapters:
        return node.error(400, f"The lora adapter '{name}' has already been loaded.", "bad_request")
    await asyncio.sleep(node.adapter_load_s / node.engine.time_scale)
    node.adapters[name] = path
    return web.Response(status=200, text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora(node: NodeView, req: web.Request) -> web.Response:
    body = await _lora_body(node, req)
    if isinstance(body, web.Response):
        return body
    name = body["lora_name"]
    if node.adapters.pop(name, None) is None:
        return node.error(404, f"The lora adapter '{name}' cannot be found.", "not_found")
    return web.Response(status=200, text=f"Success: LoRA adapter '{name}' removed successfully.")
