"""LoRA adapters on a live stack (vLLM sim nodes, health, warmup in apply mode, router): a
request for an adapter no node holds is refused once (MODEL_NOT_LOADED), warmup loads it
through /v1/load_lora_adapter where its base runs, and from then on requests for it go only to
nodes holding it; a request for the base model still goes anywhere."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import nats
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_health_helpers import eventually, infer, start_sim  # noqa: E402

from zmlcore.runtime.launch import service_argv, spawn  # noqa: E402

M = "base-model"
AD = "tenant-a"


@pytest.fixture(scope="module")
def nats_url(own_nats: str) -> str:
    return own_nats


async def test_an_adapter_is_loaded_where_requests_for_it_go(nats_url: str, tmp_path: Path) -> None:
    sims = [await start_sim(f"ad-{i}", "nvidia_h100", [M], time_scale=10.0) for i in range(3)]
    nodes = "\n".join(f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "{s.accelerator}"\nendpoint = "{s.url}"\n'
                      f'backend = "vllm"\nmodels = ["{M}"]\nadapter_slots = 2\n' for s in sims)
    path = tmp_path / "zml.toml"
    path.write_text(f'[nats]\nurl = "{nats_url}"\n[health]\npoll_interval_s = 0.1\nstartup_grace_s = 1.0\n'
                    f'[warmup]\nsweep_interval_s = 0.2\n'
                    f'[planner]\nmode = "apply"\ninterval_s = 1.0\nwindow_s = 30.0\n'
                    f'[planner.models."{M}"]\nmin_replicas = 3\n'
                    f'[adapters."{AD}"]\nbase = "{M}"\npath = "/adapters/tenant-a"\n{nodes}')
    procs = [spawn(n, service_argv(n, str(path), nats_url)) for n in ("health", "warmup", "router")]
    nc = await nats.connect(nats_url)
    try:
        for p in procs:
            assert await asyncio.to_thread(p.wait_for, "started", 20), p.tail()

        async def base_up() -> bool:
            return (await infer(nc, M))[0] == "OK"

        await eventually(base_up, timeout=20, what="base model serving")
        code, _ = await infer(nc, AD)
        assert code == "MODEL_NOT_LOADED", code

        async def adapter_ok() -> bool:
            return (await infer(nc, AD))[0] == "OK"

        await eventually(adapter_ok, timeout=20, interval=0.2, what="adapter loaded on demand")
        holders = {s.node_id for s in sims if AD in s.adapters}
        assert len(holders) == 1 and all(s.adapters.get(AD) == "/adapters/tenant-a" for s in sims
                                         if s.node_id in holders), [s.adapters for s in sims]
        outcomes = [await infer(nc, AD) for _ in range(40)]
        assert all(code == "OK" for code, _ in outcomes), outcomes
        assert {node for _, node in outcomes} <= holders, outcomes
        # the base model is not tied to the adapter's node: concurrent requests spread
        base = await asyncio.gather(*(infer(nc, M, f"question {i} " * 20) for i in range(30)))
        assert {node for code, node in base if code == "OK"} - holders, base
    finally:
        await nc.close()
        for p in reversed(procs):
            p.stop()
        for s in sims:
            await s.stop()
