"""The health service writes a node's state to the KV bucket on change and as a heartbeat, not
every poll, and readers still see live nodes fresh and a dead health service's nodes stale."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml_health.service import HealthService

from zmlcore.messages import NodeState
from zmlcore.bus.ensure import nodes_kv
from zmlcore.policy import NodeView, is_routable

STALE_S = 3.0  # [router] stale_after_s: the heartbeat is capped at a third of it (1 s)


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


async def test_idle_node_is_written_as_a_heartbeat_changes_at_once_and_dead_health_goes_stale(
    nats_private: str,
) -> None:
    sim = await start_sim("kv-1", "nvidia_h100", ["m"])
    cfg = config([node_entry(sim)], health={"kv_heartbeat_s": 30.0}, router={"stale_after_s": STALE_S})
    svc = HealthService(cfg)
    async with connected(nats_private) as nc:
        kv = await nodes_kv(nc.jetstream())
        writes: list[NodeState] = []
        watcher = await kv.watch("kv-1")

        async def follow() -> None:
            async for entry in watcher:
                if entry is not None and entry.value:
                    writes.append(msgspec.json.decode(entry.value, type=NodeState))

        task = asyncio.create_task(follow())
        await svc.start(nc)
        try:
            await eventually(lambda: writes and writes[-1].status == "up", what="node up in the KV bucket")
            polls0, n0, t0 = svc.trackers["kv-1"].polls, len(writes), time.monotonic()
            ages = []
            # Idle, polled every 0.1 s (slower on a busy box): watch 20 polls.
            while svc.trackers["kv-1"].polls - polls0 < 20 and time.monotonic() - t0 < 20.0:
                ages.append(time.time() - writes[-1].updated_at)
                await asyncio.sleep(0.05)
            polls = svc.trackers["kv-1"].polls - polls0
            written = len(writes) - n0
            assert polls >= 20, polls
            assert written <= polls / 3, (written, polls)  # the heartbeat, not every poll
            assert max(ages) < STALE_S, max(ages)  # never stale while health lives (heartbeat: 1 s)
        finally:
            await svc.stop()
        # Health is gone: nothing refreshes the state, so every reader finds the node stale.
        n_dead = len(writes)
        view = NodeView(writes[-1])
        assert is_routable(view, "m", time.time(), STALE_S) is None
        await eventually(lambda: is_routable(view, "m", time.time(), STALE_S) == "state_stale", timeout=STALE_S + 3,
                         what="stale after health stopped")
        assert len(writes) == n_dead
        svc = HealthService(cfg)  # a new health service writes every node at once
        await svc.start(nc)
        try:
            await eventually(lambda: len(writes) > n_dead, what="first write of a new health service")
            await sim.stop()  # a change readers act on: written as soon as it is seen
            await eventually(lambda: writes[-1].status != "up", timeout=5.0, what="status change written")
        finally:
            await svc.stop()
            task.cancel()
