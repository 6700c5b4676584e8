"""Hugging Face TGI: flat ``{"error", "error_type"}`` bodies, 429 when overloaded, ``GET /info``."""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.faces.base import Face
from zml_sim.faces.base import json_response
from zml_sim.faces.base import retry_headers
from zml_sim.nodeview import NodeView


class TGI(Face):
    name = "tgi"
    owner = "tgi"
    reports_cached_tokens = False  # TGI's OpenAI route reports no cached tokens

    def error_body(self, status: int, message: str, kind: str) -> Any:
        tgi_type = {"bad_request": "validation", "not_found": "validation",
                    "overloaded": "overloaded", "loading": "unavailable"}.get(kind, "generation")
        return {"error": message, "error_type": tgi_type}

    def overload(self, node: NodeView) -> web.Response:
        return json_response({"error": "Model is overloaded", "error_type": "overloaded"}, 429,
                             retry_headers(node))

    def add_routes(self, node: NodeView, r: web.UrlDispatcher) -> None:
        r.add_get("/info", partial(_info, node))


FACE = TGI()


async def _info(node: NodeView, request: web.Request) -> web.Response:
    p = node.engine.profile
    return json_response({
        "model_id": next(iter(node.engine.models), None), "model_dtype": "torch.float16",
        "model_device_type": "cuda", "max_concurrent_requests": p.max_concurrency,
        "max_best_of": 2, "max_stop_sequences": 4, "max_input_tokens": 8191,
        "max_total_tokens": MAX_MODEL_LEN, "max_waiting_tokens": 20,
        "max_client_batch_size": 4, "validation_workers": 2, "version": "3.3.0",
        "router": "text-generation-router",
    })
