"""A request pinned to a node the router's watch has not delivered yet (a node registered a
moment ago, `zml nodes` already listing it; on a loaded box the watch lags): the router reads that
node's entry directly before refusing, and serves it. The watch is paused on the server, so the
lag is real and as long as the test wants."""

from __future__ import annotations

import asyncio
import datetime
import json
import tempfile
import time

import msgspec

from test_health_helpers import start_sim
from zmlcore import subjects
from zmlcore.bus import natsinternals
from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure_kv
from zmlcore.config import parse_config
from zmlcore.messages import NodeState
from zmlcore.runtime.launch import free_port, start_nats
from zml_router.service import RouterService

M = "llama-3-8b"


def _state(node_id: str, endpoint: str, status: str = "up") -> bytes:
    return msgspec.json.encode(NodeState(node_id=node_id, accelerator_type="amd_mi300x", family="MI300X",
                                         endpoint=endpoint, status=status, models=[M],  # type: ignore[arg-type]
                                         updated_at=time.time()))


async def test_a_pinned_request_reads_ahead_of_the_routers_watch() -> None:
    port = free_port()
    sim = await start_sim("mi300x-new", "amd_mi300x", [M])
    with tempfile.TemporaryDirectory(prefix="zml-pin-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        url = f"nats://127.0.0.1:{port}"
        health = await connect(url, "health")
        nc = await connect(url, "router")
        client = await connect(url, "client")
        svc = RouterService(parse_config({}), "r-pin")
        try:
            kv = await ensure_kv(health.jetstream(), subjects.NODES_BUCKET)
            await svc.start(nc)
            assert svc.nodes_follower.watcher is not None
            consumer = natsinternals.watch_consumer(svc.nodes_follower.watcher)
            assert consumer is not None
            until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
            await health.jetstream().pause_consumer(*consumer, until.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))

            async def infer(node: str) -> tuple[str, dict[str, object]]:
                body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                        "accelerator_id": node}
                msg = await client.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
                return (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK"), json.loads(msg.data)

            await kv.put("mi300x-new", _state("mi300x-new", sim.url, status="unknown"))  # just added
            code, body = await infer("mi300x-new")
            assert code == "NO_HEALTHY_NODES", body  # read directly: known now, not up yet
            await kv.put("mi300x-new", _state("mi300x-new", sim.url))  # its first good probe
            assert "mi300x-new" in svc.table.views and svc.table.raw["mi300x-new"].status == "unknown"
            await asyncio.sleep(1.05)  # past the per-node read interval
            code, body = await infer("mi300x-new")
            assert code == "OK", body
            assert body["choices"], body  # type: ignore[index]
            code, body = await infer("nosuch")  # a node nobody registered: the same answer as before
            assert code == "BAD_REQUEST" and "not a registered node" in json.dumps(body), body
            assert "nosuch" not in svc.table.views
            # hostile ids (subject wildcards and separators, control characters, huge): refused the
            # same way, no read of another key, and the router serves on
            for bad in ("mi300x-new.>", "*", "a b", "\x00\x1b[31m", "..", "n" * 100_000):
                code, body = await infer(bad)
                assert code == "BAD_REQUEST" and "not a registered node" in json.dumps(body), (bad[:20], body)
            assert set(svc.table.views) == {"mi300x-new"}
            assert (await infer("mi300x-new"))[0] == "OK"
        finally:
            await svc.stop()
            for c in (client, nc, health):
                await c.close()
            proc.stop()
            await sim.stop()
