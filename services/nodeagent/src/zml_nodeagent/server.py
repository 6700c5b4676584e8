"""The agent's HTTP server: ``GET /zml/v1/node`` (and ``GET /health``).

The document: ``accelerator_type``, ``product_name``, ``device_count``, ``driver_version``,
``driver_detail``, ``memory_gib``, ``free_memory_gib``, ``engine``, ``models``,
``loading_models`` (always empty: a real engine does not say), ``agent``. Hardware is read at
most every ``cache_s`` seconds; models come from the engine's ``/v1/models`` when ``engine_url``
is given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
from aiohttp import web

from zml_nodeagent.smi import Hardware
from zml_nodeagent.smi import detect

AGENT_VERSION = "1"


class NodeAgent:
    def __init__(self, *, engine_url: str | None = None, engine: str = "", driver_version: str | None = None,
                 cache_s: float = 5.0, detector: Callable[[], Hardware] = detect) -> None:
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.engine = engine
        self.driver_version = driver_version
        self.cache_s = cache_s
        self.detector = detector
        self._hw: Hardware | None = None
        self._hw_at = 0.0
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def hardware(self) -> Hardware:
        async with self._lock:
            if self._hw is None or time.monotonic() - self._hw_at > self.cache_s:
                # The vendor tools block for tens of milliseconds: keep them off the loop.
                self._hw = await asyncio.to_thread(self.detector)
                self._hw_at = time.monotonic()
                if self.driver_version:
                    self._hw.driver_version = self.driver_version
            return self._hw

    async def document(self) -> dict[str, Any]:
        doc = (await self.hardware()).to_dict()
        doc.update(engine=self.engine, models=[], loading_models=[], agent=AGENT_VERSION)
        if self.engine_url:
            try:
                async with httpx.AsyncClient(timeout=2.0) as client:
                    resp = await client.get(self.engine_url + "/v1/models")
                if resp.status_code == 200:
                    doc["models"] = [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
            except (httpx.HTTPError, ValueError):
                pass  # engine down or loading: the health service sees that from the engine itself
        return doc

    def app(self) -> web.Application:
        app = web.Application()

        async def node(request: web.Request) -> web.Response:
            return web.json_response(await self.document())

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200)

        app.router.add_get("/zml/v1/node", node)
        app.router.add_get("/health", health)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        addrs = self._runner.addresses  # the bound (host, port): port 0 picks a free one
        self.port = int(addrs[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
