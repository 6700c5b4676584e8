"""The ``/sim`` admin routes of a simulated node, the same for every engine: ``GET /sim/state``,
``GET|POST|DELETE /sim/faults`` (inject failures; ``crash`` answers first, then goes down;
DELETE clears them all),
``GET|POST /sim/profile`` (change speeds at run time), ``POST /sim/load`` and ``/sim/unload``."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from zml_sim.engine import Faults, SimError
from zml_sim.faces.base import json_response
from zml_sim.nodeview import NodeView


_decode = msgspec.json.Decoder()


class BadRequest(Exception):
    pass


def add_routes(node: NodeView, r: web.UrlDispatcher) -> None:
    r.add_get("/sim/state", partial(_state, node))
    r.add_get("/sim/faults", partial(_faults_get, node))
    r.add_post("/sim/faults", partial(_faults_post, node))
    r.add_delete("/sim/faults", partial(_faults_clear, node))
    r.add_get("/sim/profile", partial(_profile_get, node))
    r.add_post("/sim/profile", partial(_profile_post, node))
    r.add_post("/sim/load", partial(_load, node))
    r.add_post("/sim/unload", partial(_unload, node))


async def _state(node: NodeView, request: web.Request) -> web.Response:
    return json_response(node.state())

async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = _decode.decode(await request.read() or b"{}")
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    return body

async def _faults_get(node: NodeView, request: web.Request) -> web.Response:
    return json_response(node.engine.faults.to_dict())

async def _faults_post(node: NodeView, request: web.Request) -> web.Response:
    try:
        faults = node.engine.faults.updated(await _json_body(request))
    except (ValueError, BadRequest) as exc:
        return node.error(400, str(exc), "bad_request")
    crash = faults.crash and not node.engine.faults.crash
    node.engine.faults = faults
    if crash:
        # Answer first, then go down: the caller learns the fault was accepted.
        node.spawn(_crash_soon(node, faults.crash_for_s))
    return json_response(faults.to_dict())

async def _faults_clear(node: NodeView, request: web.Request) -> web.Response:
    """Every fault back to its default, whatever fields it gained since the caller was written
    (a crash with ``for_s`` already under way still comes back on its own)."""
    now = node.engine.faults
    node.engine.faults = replace(Faults(), crash=now.crash, crash_for_s=now.crash_for_s)
    return json_response(node.engine.faults.to_dict())

async def _crash_soon(node: NodeView, for_s: float | None) -> None:
    await asyncio.sleep(0.02)
    await node.crash(for_s)

async def _profile_get(node: NodeView, request: web.Request) -> web.Response:
    return json_response({**asdict(node.engine.profile), "max_waiting": node.engine.max_waiting,
                           "time_scale": node.engine.time_scale})

async def _profile_post(node: NodeView, request: web.Request) -> web.Response:
    """Change performance numbers at run time (speed rescales prefill and decode)."""
    eng = node.engine
    try:
        body = await _json_body(request)
        prof = eng.profile
        changes: dict[str, Any] = {}
        for key, value in body.items():
            if key == "max_waiting":
                if value is not None and (not isinstance(value, int) or value < 0):
                    raise ValueError("max_waiting: expected an integer >= 0 or null")
                continue
            if key not in ("speed", "prefill_tps", "decode_tps", "max_concurrency",
                           "load_time_s", "memory_gib", "batch_penalty", "time_scale"):
                raise ValueError(f"unknown profile field {key!r}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                    value == 0 and key not in ("load_time_s", "batch_penalty")):
                raise ValueError(f"{key}: expected a positive number")
            if key == "max_concurrency" and not isinstance(value, int):
                raise ValueError("max_concurrency: expected an integer")
            changes[key] = value
    except (ValueError, BadRequest) as exc:
        return node.error(400, str(exc), "bad_request")
    if "max_waiting" in body:
        eng.max_waiting = body["max_waiting"]
    if "time_scale" in changes:
        eng.time_scale = float(changes.pop("time_scale"))
    if "speed" in changes:
        ratio = changes["speed"] / prof.speed
        changes.setdefault("prefill_tps", prof.prefill_tps * ratio)
        changes.setdefault("decode_tps", prof.decode_tps * ratio)
    eng.set_profile(replace(prof, **changes))
    return await _profile_get(node, request)

async def _load(node: NodeView, request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
        model = body.get("model")
        size = body.get("size_gib")
        if not isinstance(model, str) or not model:
            raise BadRequest("Field 'model' is required")
        if size is not None and (not isinstance(size, (int, float)) or size <= 0):
            raise BadRequest("size_gib must be a positive number")
    except BadRequest as exc:
        return node.error(400, str(exc), "bad_request")
    try:
        started = node.engine.load(model, None if size is None else float(size))
    except SimError as exc:
        return node.error(409, str(exc), "bad_request")
    state = "loading" if started or model in node.engine.loading else "loaded"
    return json_response({"model": model, "state": state,
                           "load_time_s": node.engine.real_seconds(node.engine.profile.load_time_s)},
                          202 if started else 200)

async def _unload(node: NodeView, request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("Field 'model' is required")
    except BadRequest as exc:
        return node.error(400, str(exc), "bad_request")
    if not node.engine.unload(model):
        return node.error(404, f"The model `{model}` is not loaded.", "not_found")
    return json_response({"model": model, "state": "unloaded"})
