"""The health service against `zml sim` imitating each engine (real NATS, real HTTP)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import httpx
import pytest

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml_health.adapters import adapter_for
from zml_health.service import HealthService
from zmlcore.messages import node_state_decoder
from zmlcore.bus.ensure import nodes_kv
from zmlcore.bus.publish import flush

M = "meta-llama/llama-3-8b-instruct"


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


@pytest.mark.parametrize("engine", ["vllm", "tgi", "sglang", "llamacpp", "openai"])
async def test_adapter_reads_a_busy_sim(engine: str) -> None:
    sim = await start_sim(f"{engine}-1", "nvidia_h100", [M], engine=engine, time_scale=1.0, max_concurrency=2)
    try:
        async with httpx.AsyncClient() as client:
            # Two running, two waiting: long generations keep them there while we probe.
            body = {"model": M, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000}
            tasks = [asyncio.create_task(client.post(sim.url + "/v1/chat/completions", json=body, timeout=30))
                     for _ in range(4)]
            await eventually(lambda: sim.engine.running == 2 and len(sim.engine.waiting) == 2, what="load")
            probe = await adapter_for(engine)(client, sim.url, 2.0, 0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert probe.ok, probe.error
        assert probe.models == [M]
        if engine != "openai":  # a plain OpenAI server exposes no queue
            assert (probe.running, probe.waiting) == (2, 2)
        if engine in ("vllm", "sglang"):
            assert probe.generation_tokens_total is not None and probe.ttft_count is not None
    finally:
        await sim.stop()


@pytest.mark.parametrize("engine", ["sglang", "llamacpp"])
async def test_engines_answering_503_while_loading_are_loading(engine: str) -> None:
    sim = await start_sim(f"{engine}-l", "nvidia_h100", [M], engine=engine, time_scale=1.0, load_time_s=30.0)
    try:
        async with httpx.AsyncClient() as client:
            probe = await adapter_for(engine)(client, sim.url, 2.0, 0)
        assert not probe.ok and probe.loading, probe
    finally:
        await sim.stop()


async def test_health_service_publishes_state_with_hardware(nats_private: str) -> None:
    sim = await start_sim("h100-a", "nvidia_h100", [M])
    cfg = config([node_entry(sim)])
    svc = HealthService(cfg)
    async with connected(nats_private) as nc:
        await svc.start(nc)
        try:
            kv = await nodes_kv(nc.jetstream())

            await eventually(lambda: svc.states.get("h100-a") and svc.states["h100-a"].status == "up", what="node up")
            st = node_state_decoder.decode((await kv.get("h100-a")).value)
            assert st.models == [M] and st.health_score == 100.0
            assert st.driver_version == "525.85" and st.device_count == 1 and st.note == ""
            assert st.poll_interval_s == 0.1 and st.source == "config"
        finally:
            await svc.stop()
            await sim.stop()


async def test_router_events_feed_error_rate_and_last_inference(nats_private: str) -> None:
    import time

    import msgspec

    from zmlcore import subjects
    from zmlcore.messages import RequestCompleted

    sims = [await start_sim("h100-e1", "nvidia_h100", [M]), await start_sim("h100-e2", "nvidia_h100", [M])]
    svc = HealthService(config([node_entry(s) for s in sims]))
    async with connected(nats_private) as nc:
        await svc.start(nc)
        try:
            await eventually(lambda: len(svc.states) == 2 and all(s.status == "up" for s in svc.states.values()))
            now = time.time()
            # e1 served 6 requests; e2 failed 3 of them before failover and served 3 itself
            for i in range(6):
                failed = ["h100-e2"] if i < 3 else []
                ev = RequestCompleted(model=M, node_id="h100-e1", ok=True, ts=now, failed_nodes=failed)
                await nc.publish(subjects.event(subjects.EVENT_COMPLETED), msgspec.json.encode(ev))
            for _ in range(3):
                ev = RequestCompleted(model=M, node_id="h100-e2", ok=True, ts=now)
                await nc.publish(subjects.event(subjects.EVENT_COMPLETED), msgspec.json.encode(ev))
            await flush(nc)
            # 3 node errors in 6 events (all delivered before the next poll publishes the rate)
            e2 = await eventually(lambda: (s := svc.states.get("h100-e2")) and s.error_rate == 0.5 and s,
                                  what="error rate from events")
            assert e2.health_score == 50.0
            e1 = await eventually(lambda: (s := svc.states.get("h100-e1")) and s.last_inference_at and s)
            assert e1.error_rate == 0.0 and e1.last_inference_at == pytest.approx(now)
        finally:
            await svc.stop()
            for s in sims:
                await s.stop()


async def test_measured_speeds_from_a_throttled_sim() -> None:
    """The health service measures a node's real prefill/decode speed from vLLM's counters:
    a sim running at half the H100 profile is seen at half speed (x its time scale)."""
    from zml_health.adapters.vllm import probe as vllm_probe
    from zml_health.tracker import Tracker
    from zmlcore.config import HealthConfig
    from zml_sim.server import SimNode

    import time

    import httpx

    # time scale 5, not faster: a 4,000-token prefill takes 0.16 s, long beside the event-loop
    # stalls of a loaded box (at 20x, 40 ms ones read the speed at a third)
    sim = SimNode(node_id="slow-h100", accelerator="nvidia_h100", models=["m"], time_scale=5, load_time_s=0.05,
                  speed=0.5)
    await sim.start(port=0)
    try:
        tr = Tracker(started_at=time.time(), grace_s=10)
        async with httpx.AsyncClient(timeout=10) as client:
            async def load() -> None:
                # distinct prompts: the sim caches prefixes, and cached tokens take no prefill time;
                # one at a time: how a loaded box staggers concurrent arrivals changes their batching
                for i in range(4):
                    await client.post(sim.url + "/v1/completions", json={
                        "model": "m", "prompt": f"{i}" + "x" * 3999, "max_tokens": 40})

            tr.observe(await vllm_probe(client, sim.url, 5.0), time.time(), HealthConfig())
            await load()
            tr.observe(await vllm_probe(client, sim.url, 5.0), time.time(), HealthConfig())
        assert tr.speed.prefill_tps is not None and tr.speed.decode_tps is not None
        # Profile: 10,000 x 0.5 prefill, 60 x 0.5 decode, both x time_scale 5. (Below: a loaded
        # box's stalls only slow what the sim does; above: the full-speed profile is 2x.)
        assert 0.5 * 25_000 < tr.speed.prefill_tps < 1.1 * 25_000, tr.speed.prefill_tps
        assert 0.6 * 150 < tr.speed.decode_tps < 1.2 * 150, tr.speed.decode_tps
    finally:
        await sim.stop()


async def test_the_listing_shows_only_states_the_routers_can_have(nats_private: str) -> None:
    """`zml nodes` (zml.admin.nodes.list) answers with what is in the node bucket, not with a poll
    whose write has not landed: a node listed "up" is "up" for a router reading the bucket. The
    bucket refuses writes for a while (its stream's largest message made tiny)."""
    import dataclasses

    from zmlcore import subjects
    from zmlcore.fleet.registry import list_nodes

    sim = await start_sim("h100-w", "nvidia_h100", [M])
    svc = HealthService(config([node_entry(sim)]))
    async with connected(nats_private) as nc:
        await svc.start(nc)
        js = nc.jetstream()
        stream = f"KV_{subjects.NODES_BUCKET}"
        try:
            kv = await nodes_kv(js)

            async def listed() -> str:
                return {n.node_id: n.status for n in await list_nodes(nc, timeout=2)}.get("h100-w", "")

            await eventually(lambda: _is(listed(), "up"), what="listed up")
            info = await js.stream_info(stream)
            await js.update_stream(dataclasses.replace(info.config, max_msg_size=16))
            await sim.crash()
            await eventually(lambda: svc.trackers["h100-w"].status == "down", what="seen down by the poll")
            await asyncio.sleep(0.3)  # more polls, each write refused
            assert await listed() == "up"
            assert node_state_decoder.decode((await kv.get("h100-w")).value).status == "up"
            await js.update_stream(dataclasses.replace(info.config, max_msg_size=-1))
            await eventually(lambda: _is(listed(), "down"), what="listed down once written")
            assert node_state_decoder.decode((await kv.get("h100-w")).value).status == "down"
        finally:
            await svc.stop()
            await sim.stop()


async def _is(status: Awaitable[str], want: str) -> bool:
    return await status == want
