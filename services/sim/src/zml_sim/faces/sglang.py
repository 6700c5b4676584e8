"""SGLang: listens at once and answers 503 while loading; ``/ready``, ``/health_generate`` (a
one-token generation through the scheduler), ``/get_model_info``, ``/get_server_info``.

Dynamic LoRA (``--enable-lora``): ``POST /load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /unload_lora_adapter {"lora_name"}`` answer ``{"success", "error_message",
"loaded_adapters"}`` (400 when not a success); a loaded adapter is listed in ``/v1/models`` with
the served model as its ``parent``. The OpenAI routes pick an adapter with ``"model":
"BASE:ADAPTER"``; a bare adapter name runs the base model without it, as SGLang does (it does
not check ``model``)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from aiohttp import web

from zml_sim.engine import SimError
from zml_sim.faces.base import Face
from zml_sim.faces.base import json_response
from zml_sim.nodeview import NodeView


class SGLang(Face):
    name = "sglang"
    owner = "sglang"
    listen_after_load = False
    loading_answers_503 = True

    def add_routes(self, node: NodeView, r: web.UrlDispatcher) -> None:
        r.add_get("/ready", node.health)
        r.add_get("/health_generate", partial(_health_generate, node))
        r.add_get("/get_model_info", partial(_model_info, node))
        r.add_get("/get_server_info", partial(_server_info, node))
        r.add_post("/load_lora_adapter", partial(_load_lora, node))
        r.add_post("/unload_lora_adapter", partial(_unload_lora, node))

    def adapter_of(self, node: NodeView, model: str) -> str | None:
        _base, sep, adapter = model.partition(":")
        return adapter if sep and adapter in node.adapters else None


FACE = SGLang()


async def _health_generate(node: NodeView, request: web.Request) -> web.Response:
    if not node.engine.models:
        return node.loading_error()
    req = node.engine.submit(next(iter(node.engine.models)), 1, 1)
    try:
        await req.text()
    except SimError:
        return web.Response(status=503)
    finally:
        node.engine.cancel(req)
    return web.Response(status=200)


async def _model_info(node: NodeView, request: web.Request) -> web.Response:
    model = next(iter(node.engine.models), None)
    return json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})


async def _server_info(node: NodeView, request: web.Request) -> web.Response:
    p = node.engine.profile
    return json_response({"version": "0.4.6", "max_running_requests": p.max_concurrency,
                          "max_total_num_tokens": node.engine.kv_capacity_tokens,
                          "model_path": next(iter(node.engine.models), None)})


def _lora_reply(node: NodeView, ok: bool, error: str = "") -> web.Response:
    return json_response({"success": ok, "error_message": error, "loaded_adapters": dict(node.adapters)},
                         200 if ok else 400)


async def _lora_body(req: web.Request) -> dict[str, Any] | None:
    try:
        body = await req.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) and isinstance(body.get("lora_name"), str) and body["lora_name"] else None


async def _load_lora(node: NodeView, req: web.Request) -> web.Response:
    body = await _lora_body(req)
    path = body.get("lora_path") if body is not None else None
    if body is None or not isinstance(path, str) or not path:
        return _lora_reply(node, False, "lora_name and lora_path are required")
    name = body["lora_name"]
    if name in node.adapters:
        return _lora_reply(node, False, f"LoRA adapter {name} is already loaded")
    await asyncio.sleep(node.adapter_load_s / node.engine.time_scale)
    node.adapters[name] = path
    return _lora_reply(node, True)


async def _unload_lora(node: NodeView, req: web.Request) -> web.Response:
    body = await _lora_body(req)
    if body is None:
        return _lora_reply(node, False, "lora_name is required")
    if node.adapters.pop(body["lora_name"], None) is None:
        return _lora_reply(node, False, f"LoRA adapter {body['lora_name']} is not loaded")
    return _lora_reply(node, True)
