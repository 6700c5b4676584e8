"""The read-only routes: GET /healthz (no key), GET /v1/models, /v1/models/{model} and
/v1/nodes and /v1/decisions/{id} (a key when keys are on)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import msgspec
from nats.aio.client import Client as NATS

from zmlcore.config import ZMLConfig
from zmlcore.fleet.decisions import lookup_decision
from zmlcore.messages import NodeState
from zml_gateway.access import Access
from zml_gateway.asgi import Receive, Scope, Send, send_json
from zml_gateway.models import model_list, model_object
from zml_gateway.nodetable import NodeTable


class Listing:
    def __init__(self, cfg: ZMLConfig, nc: NATS, nodes: Mapping[str, NodeState], access: Access,
                 table: NodeTable) -> None:
        self.cfg = cfg
        self.nc = nc
        self.nodes = nodes
        self.access = access
        self.table = table
        #: Which gateway process answered /healthz: several share one port (`zml up --gateways N`),
        #: and `zml up` says ready once each of them has answered.
        self.instance = secrets.token_hex(6)

    async def healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = self.nc.is_connected
        await send_json(send, 200 if ok else 503, {"status": "ok" if ok else "nats_disconnected",
                                                   "gateway": self.instance})

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.access.authenticate(scope)
        await send_json(send, 200, model_list(self.cfg, self.nodes))

    async def model(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.access.authenticate(scope)
        await send_json(send, 200, model_object(self.cfg, self.nodes, scope["path_params"]["model"]))

    async def decision(self, scope: Scope, receive: Receive, send: Send) -> None:
        """What ``zml why`` prints, as JSON (zmlcore.fleet.decisions)."""
        await self.access.authenticate(scope)
        record = await lookup_decision(self.nc, scope["path_params"]["decision_id"])
        await send_json(send, 200, msgspec.to_builtins(record))

    async def node_table(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.access.authenticate(scope)
        await send_json(send, 200, {"nodes": await self.table.rows()})
