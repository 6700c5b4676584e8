"""Runs the ASGI gateway on uvicorn (httptools + uvloop) beside a NATS connection, and keeps
a node table from the KV stream for /v1/models and /v1/nodes."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import uvicorn
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.costs import CostTable
from zmlcore.kvfollow import KVFollower
from zmlcore.messages import NodeState, node_state_decoder
from zmlcore.keys import KeyRing
from zmlcore.limiter import SharedLimiter
from zml_gateway.access import Access
from zml_gateway.app import Gateway
from zml_gateway.protocol import BoundedHttpTools

log = logging.getLogger("zml.gateway")


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the runner owns signals
        pass


class GatewayService:
    def __init__(self, cfg: ZMLConfig, host: str | None = None, port: int | None = None) -> None:
        self.cfg = cfg
        self.host = host or cfg.gateway.host
        self.port = cfg.gateway.port if port is None else port
        self.nodes: dict[str, NodeState] = {}
        self.costs = CostTable()
        self._follow_costs: asyncio.Task[None] | None = None
        self._server: _Server | None = None
        self._serve: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._follow_keys: asyncio.Task[None] | None = None
        self.limiter: SharedLimiter | None = None

    async def start(self, nc: NATS) -> None:
        follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=self._put_node, on_delete=self._delete_node)
        self._follow = asyncio.create_task(follower.run())
        self._follow_costs = asyncio.create_task(self.costs.follower(nc).run())
        ring = KeyRing(self.cfg.gateway.api_keys)
        keys = ring.follower(nc)
        self._follow_keys = asyncio.create_task(keys.run())
        await keys.wait_ready(2.0)  # keys known before the first request (else: 401s at start)
        self.limiter = await SharedLimiter.open(nc)
        app = Gateway(self.cfg, nc, self.nodes, self.costs, Access(self.cfg, ring, self.limiter))
        g = self.cfg.gateway
        protocol = BoundedHttpTools.with_limits(g.max_header_bytes, g.max_headers, g.header_timeout_s)
        config = uvicorn.Config(
            app, host=self.host, port=self.port, http=protocol, loop="none", lifespan="off",
            log_level="warning", access_log=False, timeout_keep_alive=30, backlog=2048,
        )
        self._server = _Server(config)
        self._serve = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serve.done():  # failed to bind: surface the error
                self._serve.result()
                raise RuntimeError(f"gateway could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serve is not None:
            await asyncio.wait([self._serve], timeout=10)
        if self.limiter is not None:
            await self.limiter.close()
        for task in (self._follow, self._follow_costs, self._follow_keys):
            if task is not None:
                task.cancel()

    def _put_node(self, key: str, value: bytes) -> None:
        try:
            self.nodes[key] = node_state_decoder.decode(value)
        except msgspec.DecodeError:
            log.warning("bad node state for %s", key)

    def _delete_node(self, key: str) -> None:
        self.nodes.pop(key, None)
