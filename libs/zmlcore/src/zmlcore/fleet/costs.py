"""The run-time cost table: prices per node that override zml.toml without a restart.

Anything that can write to NATS KV can feed it (a spot-price poller, `zml cost set`, another
system); every router applies an entry to its node table as soon as the KV watch delivers it (a
:class:`~zmlcore.bus.kvfollow.KVFollower`, so a broker restart does not freeze prices).

    await set_cost(nc, "mi300x-1", 2.1, source="spot:aws")
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.errors import BadRequestError
from zmlcore.messages import CostEntry, NodeState, cost_entry_decoder
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.bus.ensure import ensure_kv

log = logging.getLogger("zml.costs")


async def costs_kv(nc: NATS) -> KeyValue:
    return await ensure_kv(nc.jetstream(), subjects.COSTS_BUCKET)


async def set_cost(nc: NATS, node_id: str, cost_per_hour: float, *, source: str = "manual") -> CostEntry:
    if cost_per_hour < 0:
        raise BadRequestError(f"cost_per_hour must be >= 0, got {cost_per_hour}")
    entry = CostEntry(cost_per_hour=cost_per_hour, source=source, updated_at=time.time())
    await (await costs_kv(nc)).put(node_id, msgspec.json.encode(entry))
    return entry


async def clear_cost(nc: NATS, node_id: str) -> None:
    """Back to zml.toml's price."""
    await (await costs_kv(nc)).delete(node_id)


class CostTable:
    """Follows the bucket; ``apply`` gives a node state with its run-time price."""

    def __init__(self, on_change: Callable[[str], None] | None = None) -> None:
        self.entries: dict[str, CostEntry] = {}
        self.on_change = on_change

    def apply(self, state: NodeState) -> NodeState:
        entry = self.entries.get(state.node_id)
        if entry is None or entry.cost_per_hour == state.cost_per_hour:
            return state
        return msgspec.structs.replace(state, cost_per_hour=entry.cost_per_hour)

    def follower(self, nc: NATS) -> KVFollower:
        """The bucket's follower feeding this table (run it as a task)."""
        return KVFollower(nc, subjects.COSTS_BUCKET, on_put=self.put_raw, on_delete=self.delete_raw)

    def put_raw(self, key: str, value: bytes) -> None:
        try:
            self.entries[key] = cost_entry_decoder.decode(value)
        except msgspec.DecodeError:
            log.warning("bad cost entry for %s", key)
            return
        if self.on_change is not None:
            self.on_change(key)

    def delete_raw(self, key: str) -> None:
        self.entries.pop(key, None)
        if self.on_change is not None:
            self.on_change(key)
