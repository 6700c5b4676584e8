"""What the cross-replica duplicate-id check costs a request that brings its own request id.

    python benches/request_id_claims.py

A real stack on a fresh nats-server (sims, health, one router, gateway; tests/conftest.py
``launch_stack``): interleaved rounds of sequential raw-NATS requests to the router (1 output
token, so the node's time is small), once with a client id (claim before dispatch, release
before the reply: zml_router.replicas.ids) and once with ``Zml-Id-Generated`` (no claim). Then the
claim + release pair alone against the bucket. Medians; results in docs/security.md.
"""
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import MODEL, launch_stack  # noqa: E402
from zmlcore import subjects  # noqa: E402
from zmlcore.runtime.launch import free_port, start_nats  # noqa: E402
from zmlcore.bus.connect import connect  # noqa: E402
from zml_router.request.intake import claim_key  # noqa: E402
from zml_router.replicas.ids import RequestIds  # noqa: E402

N, ROUNDS = 300, 5


async def requests(url: str, client_id: bool) -> float:
    nc = await nats.connect(url)
    times = []
    for _ in range(N):
        rid = uuid.uuid4().hex
        headers = {subjects.H_REQUEST_ID: rid}
        if not client_id:
            headers[subjects.H_ID_GENERATED] = "1"
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
        t0 = time.perf_counter()
        msg = await nc.request(subjects.INFER, body, timeout=10, headers=headers)
        times.append(time.perf_counter() - t0)
        assert subjects.H_ERROR_CODE not in (msg.headers or {}), msg.data
    await nc.close()
    return statistics.median(times) * 1e3


async def claims(url: str) -> float:
    nc = await connect(url, "bench")
    ids = RequestIds("bench", 600)
    await ids.open(nc)
    times = []
    for i in range(2000):
        t0 = time.perf_counter()
        c = await ids.claim(claim_key("o", "", str(i)), 30, str(i))
        await ids.release(c)
        times.append(time.perf_counter() - t0)
    await nc.close()
    return statistics.median(times) * 1e3


async def main() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as store, tempfile.TemporaryDirectory() as tmp:
        proc = start_nats("127.0.0.1", port, store)
        url = f"nats://127.0.0.1:{port}"
        stack = launch_stack(url, Path(tmp), routers=1)
        try:
            with_id, without = [], []
            for _ in range(ROUNDS):
                with_id.append(await requests(url, True))
                without.append(await requests(url, False))
            print(f"router request, median ms per round: client id {[round(x, 2) for x in with_id]}, "
                  f"generated id {[round(x, 2) for x in without]}")
            print(f"added by the claim: {statistics.median(with_id) - statistics.median(without):.2f} ms (median of rounds)")
            print(f"claim + release alone: {await claims(url):.2f} ms median")
        finally:
            stack.stop()
            proc.stop()


if __name__ == "__main__":
    asyncio.run(main())
