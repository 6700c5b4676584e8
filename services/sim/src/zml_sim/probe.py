"""What a simulated node tells those who watch it: its models, health, the ``/zml/v1/node``
document, Prometheus metrics and its prefix cache's state."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiohttp import web

from zml_sim.engine import SimEngine
from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.faces.base import json_response
from zml_sim.kvpublish import KVEventPublisher
from zml_sim.nodeview import NodeView
from zml_sim.faces.base import Face
from zml_sim.metrics import render_metrics

_json_response = json_response


class Probe:
    """The discovery, health and metrics routes of :class:`~zml_sim.server.SimNode` (a part of it:
    the node's state is its own, declared here for the type checker)."""

    node_id: str
    accelerator: str
    engine_kind: str
    driver_version: str
    engine: SimEngine
    face: Face
    sleeping: list[str]
    #: LoRA adapters loaded at run time (vLLM): name -> path
    adapters: dict[str, str]
    started_at: float
    kv_publisher: KVEventPublisher | None

    # ----- discovery and health ----------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        created = int(self.started_at)
        owner = self.face.owner
        data = [{"id": m, "object": "model", "created": created, "owned_by": owner, "root": m,
                 "parent": None, "max_model_len": MAX_MODEL_LEN} for m in [*self.engine.models, *self.sleeping]]
        base = next(iter(self.engine.models), None)
        if base is not None:  # vLLM lists a loaded LoRA with the model it runs on as its parent
            data += [{"id": name, "object": "model", "created": created, "owned_by": owner, "root": path,
                      "parent": base, "max_model_len": MAX_MODEL_LEN} for name, path in self.adapters.items()]
        return _json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.sample_probe_loss():  # a lost probe: no answer at all
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError
        if not self.engine.models and not self.sleeping and (self.engine.loading or not self.face.idle_router):
            return self.face.loading_error()
        return self.face.health_ok()

    async def _node(self, request: web.Request) -> web.Response:
        return _json_response(self.probe())

    def probe(self) -> dict[str, Any]:
        """The ``/zml/v1/node`` document (hardware validation)."""
        return {
            "node_id": self.node_id,
            "accelerator_type": self.accelerator,
            "device_count": 1,
            "driver_version": self.driver_version,
            "memory_gib": self.engine.profile.memory_gib,
            "free_memory_gib": round(self.engine.free_memory_gib, 3),
            "engine": self.engine_kind,
            "models": list(self.engine.models),
            "loading_models": list(self.engine.loading),
        }

    # ----- metrics -----------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(cast(NodeView, self))
        return web.Response(body=text.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def prefix_cache_state(self) -> dict[str, Any] | None:
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        pub = self.kv_publisher
        return {"block_size": cache.block_size, "capacity_blocks": self.engine.cache_capacity_blocks,
                "cached_blocks": cache.blocks, "queries_tokens": sum(s.prefix_queries for s in self.engine.stats.values()),
                "hits_tokens": sum(s.prefix_hits for s in self.engine.stats.values()),
                "kv_events": None if pub is None else {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                                       "next_seq": pub.seq, "dropped": pub.dropped}}


