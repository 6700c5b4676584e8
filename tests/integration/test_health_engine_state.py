"""Issue 10 items 3-5 against `zml sim` imitating the engines (the real llama-server versions are
in tests/engine): llama.cpp's real metric names give measured speeds; a sleeping vLLM is
published as sleeping and unroutable until warmup wakes it; polls never touch ``/slots``."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml_health.adapters.llamacpp import probe as llamacpp_probe
from zml_health.service import HealthService
from zml_health.tracker import Tracker
from zml_warmup import loader
from zmlcore.config import HealthConfig
from zml_sim.server import SimNode

M = "meta-llama/llama-3-8b-instruct"


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


async def test_llamacpp_measured_speeds_from_its_own_counters() -> None:
    sim = SimNode("cpu-1", "nvidia_h100", ["m"], engine="llamacpp", time_scale=20, load_time_s=0.05, speed=0.5)
    await sim.start(port=0)
    try:
        await sim.engine.wait_loaded()
        tr = Tracker(started_at=time.time(), grace_s=10)
        async with httpx.AsyncClient(timeout=10) as client:
            tr.observe(await llamacpp_probe(client, sim.url, 5.0), time.time(), HealthConfig())
            # Distinct prompts: the sim caches prefixes, and cached tokens take no prefill time.
            # Each request starts once the previous one streams its first token: every 4,000-token
            # prefill (~40 ms here) runs alone, as the expected speed assumes (two prefills in one
            # step are a batch, and the engine's counters rightly show the batch's higher
            # throughput: started on a timer, 60 ms apart, two still met on a loaded CI box),
            # while the decodes (~200 ms) overlap.
            first = [asyncio.Event() for _ in range(4)]

            async def one(i: int) -> None:
                if i:
                    await first[i - 1].wait()
                async with client.stream("POST", sim.url + "/v1/completions", json={
                        "model": "m", "prompt": f"{i}" + "x" * 3999, "max_tokens": 120, "stream": True}) as r:
                    async for _ in r.aiter_bytes():
                        first[i].set()
                first[i].set()
            await asyncio.gather(*(one(i) for i in range(4)))
            tr.observe(await llamacpp_probe(client, sim.url, 5.0), time.time(), HealthConfig())
        assert tr.speed.prefill_tps is not None and tr.speed.decode_tps is not None
        # Profile: 10,000 x 0.5 prefill, 60 x 0.5 decode at batch 1, both x time_scale 20; the
        # four ran decoding together: the decode-step counters bring it back to batch 1.
        # ±30%: a starved event loop makes the sim's steps coarse (seen: 1.23x with the box's
        # two cores 4x oversubscribed); a speed taken from the wrong counter is off by far more.
        assert 0.7 * 100_000 < tr.speed.prefill_tps < 1.3 * 100_000, tr.speed.prefill_tps
        assert 0.8 * 600 < tr.speed.decode_tps < 1.2 * 600, tr.speed.decode_tps
    finally:
        await sim.stop()


async def test_llamacpp_probe_reads_props_not_slots() -> None:
    sim = await start_sim("cpu-2", "nvidia_h100", [M], engine="llamacpp", max_concurrency=6)
    seen: list[str] = []
    try:
        async with httpx.AsyncClient(event_hooks={"request": [lambda r: _note(seen, r)]}) as client:
            p = await llamacpp_probe(client, sim.url, 2.0, 0)
        assert p.ok and p.max_concurrency == 6 and not p.sleeping
        assert "/props" in seen and "/slots" not in seen, seen
    finally:
        await sim.stop()


async def _note(seen: list[str], request: httpx.Request) -> None:
    seen.append(request.url.path)


async def test_sleeping_vllm_is_published_unroutable_and_warmup_wakes_it(nats_private: str) -> None:
    sim = await start_sim("v-sleep", "nvidia_h100", [M], engine="vllm", load_time_s=0.5, time_scale=5.0)
    svc = HealthService(config([node_entry(sim)]))
    async with connected(nats_private) as nc:
        await svc.start(nc)
        try:
            await eventually(lambda: (s := svc.states.get("v-sleep")) and s.status == "up" and s.models == [M])
            async with httpx.AsyncClient() as client:
                assert (await client.post(sim.url + "/sleep")).status_code == 200
                st = await eventually(lambda: (s := svc.states.get("v-sleep")) and s.sleeping and s, what="sleeping")
                assert st.status == "up" and st.models == []  # asleep: nothing routable
                res = await loader.load(client, sim.url, "vllm", M)
                assert res.ok and res.mechanism == "vllm_wake_up", res
            await eventually(lambda: (s := svc.states.get("v-sleep")) and not s.sleeping and s.models == [M],
                             what="awake")
        finally:
            await svc.stop()
            await sim.stop()


async def test_speeds_say_where_they_come_from_and_when_they_last_moved(nats_private: str) -> None:
    """Issue 27 item 2: a node's speeds are the accelerator type's profile ("default", no age)
    until the engine's counters measure them ("measured", stamped when the estimate moved)."""
    sim = await start_sim("v-speed", "nvidia_h100", [M], engine="vllm", time_scale=20.0)
    # No calibration request: this is about the counters (tests/integration/test_speed_learning.py).
    svc = HealthService(config([node_entry(sim)], health={"calibrate": False}))
    async with connected(nats_private) as nc:
        await svc.start(nc)
        try:
            st = await eventually(lambda: (s := svc.states.get("v-speed")) and s.status == "up" and s)
            assert (st.speeds_source, st.speeds_at, st.speeds_measured) == ("default", 0.0, False)
            t0 = time.time()
            async with httpx.AsyncClient(timeout=30) as client:
                for i in range(3):
                    r = await client.post(sim.url + "/v1/completions",
                                          json={"model": M, "prompt": f"{i}" + "x" * 2000, "max_tokens": 100})
                    assert r.status_code == 200
                    await asyncio.sleep(0.15)  # a poll between requests: windows with tokens in them
            st = await eventually(lambda: (s := svc.states.get("v-speed")) and s.speeds_measured and s,
                                  what="measured speeds")
            assert st.speeds_source == "measured" and t0 <= st.speeds_at <= time.time()
        finally:
            await svc.stop()
            await sim.stop()
