"""SGLang: listens at once and answers 503 while loading; ``/ready``, ``/health_generate`` (a
one-token generation through the scheduler), ``/get_model_info``, ``/get_server_info``."""

from __future__ import annotations

from functools import partial

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
