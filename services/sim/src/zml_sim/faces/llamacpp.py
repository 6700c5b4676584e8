"""llama.cpp's server: listens at once ("Loading model" 503 until loaded), ``/health`` answers
``{"status": "ok"}``; ``GET /props`` (``total_slots``, ``is_sleeping``, ``model_path``),
``GET /slots``, and router mode's ``GET /models`` (each model with ``status.value`` "loaded" /
"loading"), ``POST /models/load {"model"}`` (200 ``{"success": true}``; 400 "model is already
running") and ``POST /models/unload``. A sim llama.cpp node serves router mode's load routes
beside the single-model ``/metrics`` and ``/props`` (a real router proxies those per model).

LoRA adapters as llama-server (build 11434) has them: only the ``--lora`` files it started with
(``[nodes.sim] loras``, ``zml sim --lora``), id = their order. ``GET /lora-adapters`` lists
``[{"id", "path", "scale"}]``; ``POST /lora-adapters [{"id", "scale"}]`` sets the global scales
(an adapter left out goes to 0; an id out of range: 400 "invalid adapter id"); a request's own
``"lora": [{"id", "scale"}]`` overrides them for that request, with the same rules. Nothing
loads or unloads an adapter at run time. The sim counts, per id, the requests that asked for it
at a scale > 0 (``/sim/state`` ``lora_requests``), so tests see which adapter a request ran."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from aiohttp import web

from zml_sim.engine import SimError
from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.faces.base import Face
from zml_sim.faces.base import json_response
from zml_sim.engine import SimRequest
from zml_sim.nodeview import NodeView



class LlamaCpp(Face):
    name = "llamacpp"
    owner = "llamacpp"
    listen_after_load = False
    loading_answers_503 = True
    idle_router = True
    prefill = "always"  # --prefill-assistant, on by default

    def error_body(self, status: int, message: str, kind: str) -> Any:
        ltype = {"bad_request": "invalid_request_error", "not_found": "not_found_error",
                 "overloaded": "unavailable_error", "loading": "unavailable_error"}.get(kind, "server_error")
        return {"error": {"code": status, "message": message, "type": ltype}}

    def loading_error(self) -> web.Response:
        return json_response({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}, 503)

    def health_ok(self) -> web.Response:
        return json_response({"status": "ok"})

    def reply_extra(self, req: SimRequest) -> dict[str, Any]:
        """llama-server's ``timings``: ``cache_n`` prompt tokens reused from the slot's cache,
        ``prompt_n`` computed (real milliseconds, as the sim ran them)."""
        prompt_ms = predicted_ms = 0.0
        if req.prefill_started_at is not None and req.first_token_at is not None:
            prompt_ms = (req.first_token_at - req.prefill_started_at) * 1000
        if req.first_token_at is not None:
            end = req.finished_at if req.finished_at is not None else req.first_token_at
            predicted_ms = (end - req.first_token_at) * 1000
        prompt_n = req.prompt_tokens - req.cached_tokens
        return {"timings": {
            "cache_n": req.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / prompt_ms * 1000 if prompt_ms else 0.0,
            "predicted_n": req.generated, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / req.generated if req.generated else 0.0,
            "predicted_per_second": req.generated / predicted_ms * 1000 if predicted_ms else 0.0,
        }}

    def add_routes(self, node: NodeView, r: web.UrlDispatcher) -> None:
        r.add_get("/props", partial(_props, node))
        r.add_get("/slots", partial(_slots, node))
        r.add_get("/models", partial(_router_models, node))
        r.add_post("/models/load", partial(_router_load, node))
        r.add_post("/models/unload", partial(_router_unload, node))
        r.add_get("/lora-adapters", partial(_lora_list, node))
        r.add_post("/lora-adapters", partial(_lora_set, node))

    def check_request(self, node: NodeView, body: dict[str, Any]) -> None:
        asked = body.get("lora")
        scales = _lora_scales(node, asked) if asked is not None else [a["scale"] for a in node.loras]
        for i, scale in enumerate(scales):
            if scale > 0:
                node.lora_requests[i] = node.lora_requests.get(i, 0) + 1


FACE = LlamaCpp()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def _props(node: NodeView, req: web.Request) -> web.Response:
    eng = node.engine
    return _json({"total_slots": eng.profile.max_concurrency, "is_sleeping": False,
                  "model_path": next(iter(eng.models), None), "model_alias": next(iter(eng.models), None),
                  "default_generation_settings": {"n_ctx": MAX_MODEL_LEN}})


async def _slots(node: NodeView, req: web.Request) -> web.Response:
    eng = node.engine
    busy = [*eng.decoding, *eng.prefill_queue]
    if eng.prefilling is not None and not eng.prefilling.finished:
        busy.insert(0, eng.prefilling)
    slots = []
    for i in range(eng.profile.max_concurrency):
        held = busy[i] if i < len(busy) else None
        slots.append({"id": i, "id_task": held.id if held else -1, "n_ctx": MAX_MODEL_LEN,
                      "is_processing": held is not None,
                      "next_token": {"n_decoded": held.generated if held else 0,
                                     "n_remain": held.remaining if held else -1}})
    return _json(slots)


async def _router_models(node: NodeView, req: web.Request) -> web.Response:
    eng = node.engine
    now = int(time.time())
    data = [{"id": m, "object": "model", "owned_by": "llamacpp", "created": now, "aliases": [], "tags": [],
             "status": {"value": state}}
            for state, names in (("loaded", eng.models), ("loading", eng.loading)) for m in names]
    return _json({"data": data, "object": "list"})


async def _model_field(node: NodeView, req: web.Request) -> str | web.Response:
    try:
        body = await req.json()
    except ValueError:
        return node.error(400, "Invalid JSON", "bad_request")
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        return node.error(404, "model is not found", "not_found")
    return model


async def _router_load(node: NodeView, req: web.Request) -> web.Response:
    model = await _model_field(node, req)
    if isinstance(model, web.Response):
        return model
    try:
        started = node.engine.load(model)
    except SimError as exc:
        return node.error(500, str(exc), "internal")
    if not started:
        return node.error(400, "model is already running", "bad_request")
    return _json({"success": True})


def _lora_scales(node: NodeView, entries: Any) -> list[float]:
    """Each adapter's scale as llama-server's parse_lora_request makes it: every adapter at 0,
    then each entry's ``scale`` on its ``id`` (ValueError "invalid adapter id" out of range)."""
    scales = [0.0] * len(node.loras)
    if not isinstance(entries, list):
        raise ValueError("lora must be an array of {\"id\", \"scale\"}")
    for e in entries:
        i = e.get("id", -1) if isinstance(e, dict) else -1
        scale = e.get("scale", 0.0) if isinstance(e, dict) else 0.0
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(scales):
            raise ValueError("invalid adapter id")
        scales[i] = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else 0.0
    return scales


async def _lora_list(node: NodeView, req: web.Request) -> web.Response:
    return _json(node.loras)


async def _lora_set(node: NodeView, req: web.Request) -> web.Response:
    try:
        body = await req.json()
    except ValueError:
        return node.error(400, "Invalid JSON", "bad_request")
    try:
        scales = _lora_scales(node, body)
    except ValueError as exc:
        return node.error(400, str(exc), "bad_request")
    for a, scale in zip(node.loras, scales):
        a["scale"] = scale
    return _json({"success": True})


async def _router_unload(node: NodeView, req: web.Request) -> web.Response:
    model = await _model_field(node, req)
    if isinstance(model, web.Response):
        return model
    if not node.engine.unload(model):
        return node.error(400, "model is not running", "bad_request")
    return _json({"success": True})
