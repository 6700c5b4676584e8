"""`zml nodes add|remove`: a node registered at run time takes traffic; removed, it does not."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import MODEL, Stack, launch_stack
from zml_sim.server import SimNode


@pytest.fixture(scope="module")
def small(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("nodes"), fleet=[("h100-a", "nvidia_h100", [MODEL])],
                     routers=1, poll_s=0.3)
    try:
        yield s
    finally:
        s.stop()


def zml(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zml.cli", *args], capture_output=True, text=True, timeout=60)


async def azml(*args: str) -> subprocess.CompletedProcess[str]:
    """``zml ARGS`` with the event loop free meanwhile: a sim node served from this loop must go
    on answering the health service's probes (blocked, it is marked down on a busy box)."""
    return await asyncio.to_thread(zml, *args)


async def test_add_route_list_remove(small: Stack) -> None:
    sim = SimNode(node_id="gaudi2-new", accelerator="intel_gaudi2", models=[MODEL], time_scale=20, load_time_s=0.1)
    await sim.start(port=0)
    try:
        out = await azml("nodes", "add", "gaudi2-new", "--accelerator", "intel_gaudi2", "--url", sim.url,
                  "--serves", MODEL, "--nats-url", small.nats_url)
        assert out.returncode == 0, out.stderr
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "accelerator_id": "gaudi2-new"}
        async with httpx.AsyncClient(base_url=small.gateway_url, timeout=10) as client:
            deadline = time.monotonic() + 10
            while True:
                r = await client.post("/v1/chat/completions", json=body)
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert r.status_code == 200, r.text
            assert r.json()["zml"]["node_id"] == "gaudi2-new"
            listed = await azml("nodes", "--json", "--endpoint", small.gateway_url)
            assert listed.returncode == 0, listed.stderr
            assert "gaudi2-new" in {n["node_id"] for n in json.loads(listed.stdout)["nodes"]}
            table = await azml("nodes", "--endpoint", small.gateway_url)
            assert "gaudi2-new" in table.stdout and "intel_gaudi2" in table.stdout
            out = await azml("nodes", "remove", "gaudi2-new", "--nats-url", small.nats_url)
            assert out.returncode == 0, out.stderr
            deadline = time.monotonic() + 10
            while (r := await client.post("/v1/chat/completions", json=body)).status_code == 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            assert r.json()["error"]["code"] == "BAD_REQUEST"  # no such node any more
        bad = await azml("nodes", "add", "x1", "--accelerator", "nvidia_h999", "--url", "http://127.0.0.1:1",
                  "--nats-url", small.nats_url)
        assert bad.returncode != 0 and "nvidia_h999" in bad.stderr and "Traceback" not in bad.stderr
    finally:
        await sim.stop()


async def test_a_decision_id_is_looked_up_by_zml_why_and_http(small: Stack) -> None:
    """A reply's decision id names what the router chose and believed: `zml why ID` and
    GET /v1/decisions/{id} answer it; an id no router remembers is a 404 / one line."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "why here?"}], "max_tokens": 3}
    async with httpx.AsyncClient(base_url=small.gateway_url, timeout=10) as client:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        did = r.headers["x-zml-decision-id"]
        assert did == r.json()["zml"]["decision_id"]
        got = await client.get(f"/v1/decisions/{did}")
        assert got.status_code == 200, got.text
        record = got.json()
        assert record["decision_id"] == did and record["node_id"] == "h100-a" and record["model"] == MODEL
        assert record["outcome"] == "ok" and record["time_to_first_token"] > 0
        assert record["request_id"] == r.json()["zml"]["request_id"]
        assert record["prefill_tps"] > 0 and record["speeds_source"]
        missing = await client.get("/v1/decisions/00000000deadbeef")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND", missing.text
        bad = await client.get("/v1/decisions/not-an-id!")
        assert bad.status_code == 400, bad.text
    out = zml("why", did, "--nats-url", small.nats_url)
    assert out.returncode == 0, out.stderr
    assert f"decision {did}" in out.stdout and "node     h100-a" in out.stdout, out.stdout
    assert "prompt tokens/s" in out.stdout and "outcome  ok, TTFT" in out.stdout, out.stdout
    as_json = zml("why", did, "--json", "--nats-url", small.nats_url)
    assert json.loads(as_json.stdout)["decision_id"] == did
    out = zml("why", "00000000deadbeef", "--nats-url", small.nats_url)
    assert out.returncode == 1 and "[NOT_FOUND]" in out.stderr and "Traceback" not in out.stderr, out.stderr
