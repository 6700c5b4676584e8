"""Adapters on a live stack beyond vLLM's /v1/load_lora_adapter (issue 32 items 2 and 3):

* vLLM nodes with a LoRA resolver (``adapters_on_request``; the sim imitates vLLM's
  ``lora_filesystem_resolver``): a request for an adapter no node holds is served, not refused,
  by a node that loads it for the request (the router's estimate costs the load time, and the
  load that request waited for is timed into the node's adapter load time), and once health
  lists it there the requests go where it is loaded;
* SGLang nodes: warmup loads an adapter through SGLang's ``/load_lora_adapter``, routers send
  its requests as ``BASE:ADAPTER`` (a bare name would run the base model), and health publishes
  the node's measured adapter load time."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import nats
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_health_helpers import eventually, infer, start_sim  # noqa: E402

from zmlcore import subjects  # noqa: E402
from zmlcore.messages import NodeState  # noqa: E402
from zmlcore.runtime.launch import service_argv, spawn  # noqa: E402

M = "base-model"
AD = "tenant-a"


@pytest.fixture(scope="module")
def nats_url(own_nats: str) -> str:
    return own_nats


async def node_states(nc: nats.NATS) -> dict[str, NodeState]:
    msg = await nc.request(subjects.admin_nodes("list"), b"{}", timeout=5)
    nodes = msgspec.json.decode(msg.data, type=dict[str, list[NodeState]])["nodes"]
    return {n.node_id: n for n in nodes}


def _config(nats_url: str, nodes: str, extra: str = "") -> str:
    return (f'[nats]\nurl = "{nats_url}"\n[health]\npoll_interval_s = 0.1\nstartup_grace_s = 1.0\n{extra}'
            f'[adapters."{AD}"]\nbase = "{M}"\npath = "/adapters/tenant-a"\n{nodes}')


async def test_a_vllm_resolver_node_serves_an_adapter_held_nowhere(nats_url: str, tmp_path: Path) -> None:
    lib = tmp_path / "loras"
    (lib / AD).mkdir(parents=True)
    (lib / AD / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": M}))
    plain = await start_sim("plain-0", "nvidia_h100", [M], time_scale=10.0)
    resolving = await start_sim("resolve-0", "nvidia_h100", [M], time_scale=10.0, lora_resolver_dir=str(lib),
                                adapter_load_s=1.0)
    nodes = "\n".join(
        f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "{s.accelerator}"\nendpoint = "{s.url}"\n'
        f'backend = "vllm"\nmodels = ["{M}"]\nadapter_slots = 2\nadapters_on_request = {str(on).lower()}\n'
        for s, on in ((plain, False), (resolving, True)))
    path = tmp_path / "zml.toml"
    path.write_text(_config(nats_url, nodes))
    procs = [spawn(n, service_argv(n, str(path), nats_url)) for n in ("health", "router")]
    nc = await nats.connect(nats_url)
    try:
        for p in procs:
            assert await asyncio.to_thread(p.wait_for, "started", 20), p.tail()

        async def both_up() -> bool:
            states = await node_states(nc)
            return all(st.status == "up" and M in st.models for st in states.values()) and len(states) == 2 \
                and (await infer(nc, M))[0] == "OK"

        await eventually(both_up, timeout=20, what="both nodes serving the base model")
        code, node = await infer(nc, AD)
        assert (code, node) == ("OK", "resolve-0")  # loaded for the request, not refused
        assert resolving.adapters == {AD: str(lib / AD)} and resolving.adapter_requests == {AD: 1}
        assert plain.adapters == {} and plain.adapter_requests == {}

        async def listed() -> bool:
            return AD in (await node_states(nc))["resolve-0"].adapters

        await eventually(listed, timeout=10, what="health lists the adapter where it was loaded")

        async def load_timed() -> bool:  # 1 s simulated at x10: the request's first byte less its estimate
            return 0.07 <= (await node_states(nc))["resolve-0"].adapter_load_s <= 0.5

        await eventually(load_timed, timeout=10, what="health publishes the load the request's engine made")
        outcomes = [await infer(nc, AD) for _ in range(10)]
        assert outcomes == [("OK", "resolve-0")] * 10, outcomes
        assert resolving.adapter_requests == {AD: 11}
    finally:
        await nc.close()
        for p in reversed(procs):
            p.stop()
        await plain.stop()
        await resolving.stop()


async def test_sglang_adapters_load_through_its_api_and_run_as_base_colon_adapter(nats_url: str,
                                                                                  tmp_path: Path) -> None:
    sims = [await start_sim(f"sg-{i}", "nvidia_h100", [M], engine="sglang", time_scale=10.0, adapter_load_s=2.0)
            for i in range(2)]
    nodes = "\n".join(f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "{s.accelerator}"\nendpoint = "{s.url}"\n'
                      f'backend = "sglang"\nmodels = ["{M}"]\nadapter_slots = 2\n' for s in sims)
    path = tmp_path / "zml.toml"
    path.write_text(_config(nats_url, nodes, '[warmup]\nsweep_interval_s = 0.2\n[planner]\nmode = "apply"\n'
                                             f'interval_s = 1.0\nwindow_s = 30.0\n[planner.models."{M}"]\n'
                                             'min_replicas = 2\n'))
    procs = [spawn(n, service_argv(n, str(path), nats_url)) for n in ("health", "warmup", "router")]
    nc = await nats.connect(nats_url)
    try:
        for p in procs:
            assert await asyncio.to_thread(p.wait_for, "started", 20), p.tail()

        async def base_up() -> bool:
            return (await infer(nc, M))[0] == "OK"

        await eventually(base_up, timeout=20, what="base model serving")
        assert (await infer(nc, AD))[0] == "MODEL_NOT_LOADED"  # SGLang loads no adapter on request

        async def adapter_ok() -> bool:
            return (await infer(nc, AD))[0] == "OK"

        await eventually(adapter_ok, timeout=20, interval=0.2, what="adapter loaded through /load_lora_adapter")
        holders = [s for s in sims if AD in s.adapters]
        assert len(holders) >= 1 and all(s.adapters[AD] == "/adapters/tenant-a" for s in holders)
        outcomes = [await infer(nc, AD) for _ in range(10)]
        assert all(code == "OK" for code, _ in outcomes), outcomes
        # every one ran on the adapter: the router named it BASE:ADAPTER
        assert sum(s.adapter_requests.get(AD, 0) for s in sims) == 11

        async def load_time_published() -> bool:
            st = (await node_states(nc))[holders[0].node_id]
            return st.adapter_load_s >= 0.15  # 2 s simulated at x10 (0.2 s), as warmup timed it

        await eventually(load_time_published, timeout=10, what="health publishes the measured adapter load time")
    finally:
        await nc.close()
        for p in reversed(procs):
            p.stop()
        for s in sims:
            await s.stop()
