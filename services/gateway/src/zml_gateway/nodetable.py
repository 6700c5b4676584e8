"""The fleet as the gateway shows it (``GET /v1/nodes`` and the dashboard): health's view of
every node from the KV bucket, with run-time prices and the routers' own view (in flight,
cooldown, saturation) gathered from every router replica."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.fleet.costs import CostTable
from zmlcore.messages import NodeState

#: How long the routers' answers to one state request are collected.
GATHER_S = 0.15


class NodeTable:
    def __init__(self, nc: NATS, nodes: Mapping[str, NodeState], costs: CostTable) -> None:
        self.nc = nc
        self.nodes = nodes  # kept current by the service from the KV stream
        self.costs = costs

    async def rows(self) -> list[dict[str, Any]]:
        """One row per node, sorted by id: its state, ``cost_per_hour``, and ``routers`` (how
        many replicas answered about it) with their largest ``in_flight``, ``cooldown_s`` and
        ``saturated_s``."""
        views: list[dict[str, Any]] = []
        inbox = self.nc.new_inbox()

        async def collect(msg: Any) -> None:
            try:
                views.append(msgspec.json.decode(msg.data))
            except msgspec.DecodeError:
                pass

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(subjects.ROUTERS_STATE, b"", reply=inbox)
            await asyncio.sleep(GATHER_S)
        finally:
            await sub.unsubscribe()
        out = []
        for node_id in sorted(self.nodes):
            row: dict[str, Any] = msgspec.to_builtins(self.costs.apply(self.nodes[node_id]))
            row.setdefault("cost_per_hour", 0.0)  # omitted as a default, yet a free node's price
            seen = [v["nodes"][node_id] for v in views if node_id in v.get("nodes", {})]
            row["routers"] = len(seen)
            row["in_flight"] = max((r["outstanding"] for r in seen), default=0)
            row["cooldown_s"] = max((r["cooldown_s"] for r in seen), default=0.0)
            row["saturated_s"] = max((r["saturated_s"] for r in seen), default=0.0)
            out.append(row)
        return out
