"""`zml node-agent` beside an engine: the health service validates the node through the agent's
probe endpoint; a node without any probe is accepted with a note, or kept out in strict mode."""

from __future__ import annotations

import httpx
import pytest

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml_health.service import HealthService
from zmlcore.runtime.launch import free_port
from zml_nodeagent.server import NodeAgent
from zml_nodeagent.smi import Hardware

M = "meta-llama/llama-3-8b-instruct"


@pytest.fixture(scope="module")
def nats_url() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


def gaudi2(driver: str) -> Hardware:
    return Hardware(accelerator_type="intel_gaudi2", product_name="HL-225", device_count=8, driver_version=driver,
                    memory_gib=768.0, free_memory_gib=700.5, source="hl-smi")


async def test_agent_document_reports_engine_models() -> None:
    sim = await start_sim("g-1", "intel_gaudi2", [M])
    agent = NodeAgent(engine_url=sim.url, engine="vllm", detector=lambda: gaudi2("1.17.0-e4b9d9d"))
    await agent.start()
    try:
        async with httpx.AsyncClient() as client:
            doc = (await client.get(f"http://127.0.0.1:{agent.port}/zml/v1/node")).json()
        assert doc["accelerator_type"] == "intel_gaudi2" and doc["models"] == [M] and doc["free_memory_gib"] == 700.5
    finally:
        await agent.stop()
        await sim.stop()


@pytest.mark.parametrize(("driver", "strict", "status", "text"), [
    ("1.17.0-e4b9d9d", False, "up", ""),
    ("1.11.0", False, "invalid", "driver 1.11.0 is older than the minimum 1.12"),
    (None, False, "up", "no node probe"),       # no agent at all: accepted with a note
    (None, True, "invalid", "no node probe"),   # ... unless strict
])
async def test_validation_through_the_agent(nats_url: str, driver: str | None, strict: bool, status: str,
                                            text: str) -> None:
    sim = await start_sim("gaudi2-1", "intel_gaudi2", [M])
    agent = NodeAgent(detector=lambda: gaudi2(driver or ""))
    probe_port = free_port()
    if driver is not None:
        await agent.start(port=probe_port)
    cfg = config([node_entry(sim, probe_endpoint=f"http://127.0.0.1:{probe_port}")],
                 health={"require_node_probe": strict})
    svc = HealthService(cfg)
    try:
        async with connected(nats_url) as nc:
            await svc.start(nc)
            try:
                st = await eventually(lambda: (s := svc.states.get("gaudi2-1")) and s.status in ("up", "invalid") and s,
                                      what="validated")
                assert st.status == status, st
                assert text in (st.reason or st.note)
                if driver and status == "up":
                    assert st.free_memory_gib == 700.5 and st.device_count == 8 and st.memory_gib == 768.0
            finally:
                await svc.stop()
    finally:
        await agent.stop()
        await sim.stop()
