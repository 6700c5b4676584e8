"""The router's local node table: fed by the health service's KV stream and by local and
peer in-flight counters. Decisions read it without touching the network."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.js.kv import KeyValue

from zmlcore.messages import InflightDelta, NodeState, node_state_decoder
from zmlcore.policy import NodeView

log = logging.getLogger("zml.router.table")

_KV_DELETE = ("DEL", "PURGE")


class NodeTable:
    def __init__(self) -> None:
        self.views: dict[str, NodeView] = {}
        # Cached list for choose_node; rebuilt only when membership changes.
        self._list: list[NodeView] | None = None
        self.ready = asyncio.Event()
        #: Called after every state update (the saturation queue re-checks capacity).
        self.on_change: Callable[[], None] | None = None

    def nodes(self) -> list[NodeView]:
        if self._list is None:
            self._list = list(self.views.values())
        return self._list

    def upsert(self, state: NodeState) -> None:
        view = self.views.get(state.node_id)
        if view is None:
            self.views[state.node_id] = NodeView(state)
            self._list = None
        else:
            view.state = state

    def remove(self, node_id: str) -> None:
        if self.views.pop(node_id, None) is not None:
            self._list = None

    def apply_delta(self, d: InflightDelta) -> None:
        view = self.views.get(d.node_id)
        if view is not None:
            view.outstanding = max(0, view.outstanding + d.outstanding)
            view.pending = max(0, view.pending + d.pending)

    async def follow(self, kv: KeyValue) -> None:
        """Apply every KV update forever (snapshot first: a late router still sees all)."""
        watcher = await kv.watchall()
        try:
            async for entry in watcher:
                if entry is None:  # initial snapshot delivered
                    self.ready.set()
                    continue
                if entry.operation in _KV_DELETE or not entry.value:
                    self.remove(entry.key)
                    continue
                try:
                    self.upsert(node_state_decoder.decode(entry.value))
                except msgspec.DecodeError as exc:
                    log.warning("bad node state for %s: %s", entry.key, exc)
                if self.on_change is not None:
                    self.on_change()
                if entry.delta == 0:
                    self.ready.set()
        finally:
            try:
                await watcher.stop()
            except Exception:
                pass
