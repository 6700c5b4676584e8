"""Runs the ASGI gateway on uvicorn (httptools + uvloop) beside a NATS connection, and keeps
a node table from the KV stream for /v1/models and /v1/nodes."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import msgspec
import uvicorn
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.fleet.catalog import known_models
from zmlcore.fleet.costs import CostTable
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.messages import NodeState, node_state_decoder
from zmlcore.access.apikeys import KeyRing
from zmlcore.batch.api import BatchApi
from zmlcore.batch.store import BatchStore
from zmlcore.access.limiter import SharedLimiter
from zml_gateway.access import Access
from zml_gateway.app import Gateway
from zml_gateway.batches import BatchRoutes
from zml_gateway.dashboard import Dashboard
from zml_gateway.grpc_front import GrpcFront
from zml_gateway.observe import Observed
from zml_gateway.http2 import H2Limits
from zml_gateway.protocol import BoundedHttpTools
from zml_gateway.uvicorninternals import GatewayServer, check as check_uvicorn

log = logging.getLogger("zml.gateway")


_KEEPALIVE_S = 30


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket other gateway processes can bind too (SO_REUSEPORT): the kernel
    spreads new connections over them, so `zml up` can run one per core on one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class GatewayService:
    def __init__(self, cfg: ZMLConfig, host: str | None = None, port: int | None = None,
                 reuse_port: bool = False, grpc_port: int | None = None) -> None:
        check_uvicorn()  # at start-up, before connecting: a uvicorn the protocol does not fit is one line
        self.cfg = cfg
        self.reuse_port = reuse_port  # several gateway processes on one port (`zml up`)
        self.host = host or cfg.gateway.host
        self.port = cfg.gateway.port if port is None else port
        self.grpc_port = cfg.gateway.grpc_port if grpc_port is None else grpc_port
        self._grpc: GrpcFront | None = None
        self.nodes: dict[str, NodeState] = {}
        self.costs = CostTable()
        self._follow_costs: asyncio.Task[None] | None = None
        self._server: GatewayServer | None = None
        self._serve: asyncio.Task[None] | None = None
        self._follow: asyncio.Task[None] | None = None
        self._dashboard: Dashboard | None = None
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
        batch_api = None
        if self.cfg.batch.enabled:  # the Batch API's store: created by whichever service starts first
            names = BatchRoutes.policy_names(self.cfg)
            batch_api = BatchApi(await BatchStore.open(nc, self.cfg.batch), self.cfg, policy_known=names.__contains__)
        gateway = Gateway(self.cfg, nc, self.nodes, self.costs, Access(self.cfg, ring, self.limiter, keys.refresh), batch_api)
        self._dashboard = Dashboard(nc, gateway.access, gateway.node_table,
                                    models=lambda: known_models(self.cfg.model_names(), self.nodes.values()),
                                    batch_store=batch_api.store if batch_api is not None else None)
        await self._dashboard.start()
        app = Observed(gateway, serve_metrics=self.cfg.metrics.gateway, dashboard=self._dashboard)
        g = self.cfg.gateway
        h2 = H2Limits(max_header_bytes=g.max_header_bytes, max_headers=g.max_headers,
                      header_timeout_s=g.header_timeout_s, idle_timeout_s=_KEEPALIVE_S,
                      max_streams=g.http2_max_streams) if g.http2 else None
        protocol = BoundedHttpTools.with_limits(g.max_header_bytes, g.max_headers, g.header_timeout_s, h2)
        tls: dict[str, object] = {}
        if g.tls_cert_file:  # HTTPS; with a client CA, clients must present a certificate it signed
            tls = {"ssl_certfile": g.tls_cert_file, "ssl_keyfile": g.tls_key_file}
            if g.tls_client_ca_file:
                tls |= {"ssl_ca_certs": g.tls_client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            app, host=self.host, port=self.port, http=protocol, loop="none", lifespan="off",
            log_level="warning", access_log=False, timeout_keep_alive=_KEEPALIVE_S, backlog=2048,
            # X-Forwarded-For believed only from the operator's proxies (uvicorn's default
            # trusts 127.0.0.1, letting a local client pick its rate-limit address), and no
            # middleware on every request without them.
            proxy_headers=bool(g.trusted_proxies), forwarded_allow_ips=list(g.trusted_proxies), **tls,  # type: ignore[arg-type]
        )
        config.load()
        if config.ssl is not None:  # ALPN: HTTP/2 when both sides speak it, else HTTP/1.1
            config.ssl.set_alpn_protocols(["h2", "http/1.1"] if g.http2 else ["http/1.1"])
        sockets = [_reuse_port_socket(self.host, self.port)] if self.reuse_port else None
        if self.grpc_port:  # zml.v1.Zml beside HTTP, through the same app (zml_gateway.grpc_front)
            self._grpc = GrpcFront(app, self.cfg, gateway.intake.body_limit(), self.host, self.grpc_port,
                                   reuse_port=self.reuse_port)
            await self._grpc.start()
        self._server = GatewayServer(config)  # the runner owns SIGTERM/SIGINT (see GatewayServer)
        self._serve = asyncio.create_task(self._server.serve(sockets=sockets))
        while not self._server.started:
            if self._serve.done():  # failed to bind: surface the error
                self._serve.result()
                raise RuntimeError(f"gateway could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop()
        if self._server is not None:
            self._server.should_exit = True
        if self._serve is not None:
            await asyncio.wait([self._serve], timeout=10)
        if self._dashboard is not None:
            await self._dashboard.stop()
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
