"""The router's node table across a broker restart whose snapshot lacks nodes (no delete marker):
such a node ages out like one health stopped writing, so routing never loses a fresh node for a
moment (the chaos suite's MODEL_NOT_LOADED), and a node that is really gone still leaves within
``stale_after_s``; a node deleted with a marker leaves at once."""

from __future__ import annotations

import asyncio
import tempfile
import time

import msgspec
import pytest

from test_health_helpers import eventually
from zmlcore import subjects
from zmlcore.config import parse_config
from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError
from zmlcore.runtime.launch import free_port, start_nats
from zmlcore.messages import NodeState
from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure_kv
from zmlcore.policy import RouteRequest
from zmlcore.policy.resolve import builtin_policy
from zml_router.service import RouterService

STALE_S = 5.0


def _state(node_id: str, updated_at: float) -> bytes:
    return msgspec.json.encode(NodeState(node_id=node_id, accelerator_type="nvidia_h100", family="H100",
                                         endpoint="http://127.0.0.1:9", status="up", models=["m"],
                                         updated_at=updated_at))


async def test_nodes_lost_by_a_snapshot_age_out_and_deleted_ones_leave_at_once() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-vanish-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        url = f"nats://127.0.0.1:{port}"
        writer = await connect(url, "health")
        nc = await connect(url, "router")
        svc = RouterService(parse_config({"router": {"stale_after_s": STALE_S}}), "r-vanish")
        latency = builtin_policy("latency")
        try:
            kv = await ensure_kv(writer.jetstream(), subjects.NODES_BUCKET)
            await svc.start(nc)
            now = time.time()
            written = {"fresh": now, "older": now - STALE_S / 2, "removed": now}
            for node_id, at in written.items():
                await kv.put(node_id, _state(node_id, at))
            await eventually(lambda: set(svc.table.views) == set(written), what="the router's table")
            # Gone from the stream without a marker (as a bad or lost snapshot reads), and one
            # deleted as health does it (`zml nodes remove`): the router is told only by the re-watch.
            js = writer.jetstream()
            for node_id in ("fresh", "older"):
                await js.purge_stream(f"KV_{subjects.NODES_BUCKET}", subject=f"$KV.{subjects.NODES_BUCKET}.{node_id}")
            await kv.delete("removed")
            await eventually(lambda: "removed" not in svc.table.views, what="the live delete")
            await kv.put("removed", _state("removed", now))  # back, then deleted while nobody watches
            await eventually(lambda: "removed" in svc.table.views, what="re-added")
            synced = svc.nodes_follower.synced_at
            stream = f"KV_{subjects.NODES_BUCKET}"
            for info in await js.consumers_info(stream):
                await js.delete_consumer(stream, info.name)
            await kv.delete("removed")
            await asyncio.sleep(0.3)  # on disk before the kill
            proc.popen.kill()
            proc.popen.wait(10)
            proc = start_nats("127.0.0.1", port, store)
            await eventually(lambda: svc.nodes_follower.synced_at > synced, timeout=15, what="the re-watch's snapshot")
            resynced = time.time()
            assert resynced < written["fresh"] + STALE_S - 1, "the restart took too long for this test"
            assert "removed" not in svc.table.views  # its delete marker was in the snapshot

            # Kept while fresh: every decision meanwhile finds a node, none gets MODEL_NOT_LOADED.
            def decide() -> str:
                return svc.admit(RouteRequest(model="m"), latency).node_id
            assert decide() in ("fresh", "older")
            # ... and each leaves once stale: routing skips it from stale_after_s on (NO_HEALTHY_NODES,
            # retryable), and the table drops it then too.
            picks: list[tuple[float, str]] = []
            errors: list[str] = []
            left: dict[str, float] = {}
            while svc.table.views and time.time() < written["fresh"] + STALE_S + 5:
                t = time.time()
                left.update((n, t) for n in written if n not in svc.table.views and n not in left)
                try:
                    picks.append((t, decide()))
                except NoHealthyNodesError:
                    errors.append("NO_HEALTHY_NODES")
                except ModelNotLoadedError:
                    errors.append(f"MODEL_NOT_LOADED with {sorted(svc.table.views)} in the table")
                await asyncio.sleep(0.05)
            assert not svc.table.views, f"not gone {STALE_S} s after their last state: {sorted(svc.table.views)}"
            left.update((n, time.time()) for n in written if n not in left)
            late = {n: round(left[n] - written[n] - STALE_S, 2) for n in ("fresh", "older")}
            assert all(-0.5 < s < 1.0 for s in late.values()), f"left the table s after turning stale: {late}"
            assert all(t - written[node] <= STALE_S + 0.01 for t, node in picks), "routed to a stale node"
            assert not [e for e in errors if e.startswith("MODEL")], errors
            assert picks and picks[-1][0] > written["older"] + STALE_S, "the fresh node was kept after the older left"
            with pytest.raises(ModelNotLoadedError):  # now no node lists the model: the right answer
                decide()
        finally:
            await svc.stop()
            await nc.close()
            await writer.close()
            proc.stop()
