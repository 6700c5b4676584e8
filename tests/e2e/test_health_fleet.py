"""The health service as users run it (its own process, real NATS) with `zml sim` nodes and a
router: a node going down and coming back, flapping suppression, stale state, hardware
validation, run-time registration across restarts, MODEL_NOT_LOADED.

Destructive, so everything here is private: its own nats-server, sims and services."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_health_helpers import eventually, start_sim  # noqa: E402

from zmlcore import subjects  # noqa: E402
from zmlcore.errors import BadRequestError  # noqa: E402
from zmlcore.fleet.registry import add_node, list_nodes, remove_node  # noqa: E402
from zmlcore.runtime.launch import Proc, service_argv, spawn  # noqa: E402
from zmlcore.messages import NodeSpec, NodeState  # noqa: E402
from zml_sim.server import SimNode  # noqa: E402

M = "meta-llama/llama-3-8b-instruct"
COLD = "mistralai/mistral-7b-instruct"


@pytest.fixture(scope="module")
def nats_url(own_nats: str) -> str:
    """This module's own broker (its tests delete and re-create buckets)."""
    return own_nats


@dataclass
class Fleet:
    nats_url: str
    config: str
    sims: dict[str, SimNode]
    procs: dict[str, Proc]

    def restart_health(self) -> None:
        self.procs["health"].stop()
        self.procs["health"] = spawn("health", service_argv("health", self.config, self.nats_url))


def toml(sims: dict[str, SimNode], declared: dict[str, str]) -> str:
    out = ["[health]\npoll_interval_s = 0.15\njitter = 0.1\nprobe_timeout_s = 1.0\ndown_after = 3\n"
           "up_after = 2\nstartup_grace_s = 1.0\n",
           "[router]\nstale_after_s = 1.5\ncooldown_s = 0.5\n",
           f'[models."{COLD}"]\nwarm = false\n']
    for node_id, sim in sims.items():
        models = ", ".join(f'"{m}"' for m in [M, COLD])
        out.append(f'[[nodes]]\nid = "{node_id}"\naccelerator = "{declared.get(node_id, sim.accelerator)}"\n'
                   f'endpoint = "{sim.url}"\nmodels = [{models}]\n')
    return "\n".join(out)


@pytest.fixture(scope="module")
async def fleet(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Fleet]:
    sims = {
        "h100-a": await start_sim("h100-a", "nvidia_h100", [M], load_time_s=2.0, time_scale=10.0),
        "h100-b": await start_sim("h100-b", "nvidia_h100", [M]),
        # an H100 whose driver is older than 525.85
        "h100-old": await start_sim("h100-old", "nvidia_h100", [M], driver_version="520.61.05"),
        # declared H100 in zml.toml, but the hardware is an MI300X
        "h100-fake": await start_sim("h100-fake", "amd_mi300x", [M]),
    }
    path = tmp_path_factory.mktemp("health-fleet") / "zml.toml"
    path.write_text(toml(sims, {"h100-fake": "nvidia_h100"}))
    procs = {"health": spawn("health", service_argv("health", str(path), nats_url)),
             "router": spawn("router", service_argv("router", str(path), nats_url, "--router-id", "r1"))}
    f = Fleet(nats_url, str(path), sims, procs)
    try:
        assert await asyncio.to_thread(procs["router"].wait_for, "started", 20), procs["router"].tail()
        async with connect(nats_url) as nc:
            await eventually(lambda: by_id(nc), timeout=20, what="health answering")
            await eventually(lambda: status_is(nc, {"h100-a": "up", "h100-b": "up"}), timeout=20, what="fleet up")
        yield f
    finally:
        for p in reversed(list(procs.values())):
            p.stop()
        for s in sims.values():
            await s.stop()


class connect:
    def __init__(self, url: str) -> None:
        self.url = url

    async def __aenter__(self) -> NATS:
        self.nc = await nats.connect(self.url, max_reconnect_attempts=0)
        return self.nc

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()


async def by_id(nc: NATS) -> dict[str, NodeState]:
    try:
        return {n.node_id: n for n in await list_nodes(nc, timeout=1.0)}
    except Exception:
        return {}


async def status_is(nc: NATS, want: dict[str, str]) -> bool:
    nodes = await by_id(nc)
    return all(n in nodes and nodes[n].status == s for n, s in want.items())


async def infer(nc: NATS, model: str = M, **extra: Any) -> tuple[str, dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
    code = (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK")
    return code, json.loads(msg.data)


async def test_driver_mismatch_and_wrong_hardware_are_invalid_with_a_reason(fleet: Fleet) -> None:
    async with connect(fleet.nats_url) as nc:
        await eventually(lambda: status_is(nc, {"h100-old": "invalid", "h100-fake": "invalid"}), what="invalid")
        nodes = await by_id(nc)
        assert nodes["h100-old"].reason == ("driver 520.61.05 is older than the minimum 525.85 (CUDA 12.0+) "
                                            "for nvidia_h100")
        assert "declared nvidia_h100" in nodes["h100-fake"].reason and "reports amd_mi300x" in nodes["h100-fake"].reason
        assert nodes["h100-a"].driver_version == "525.85" and nodes["h100-a"].reason == ""
        # kept out of routing: pinning says why, and unpinned traffic never lands there
        code, body = await infer(nc, accelerator_id="h100-old")
        assert code == "NO_HEALTHY_NODES" and "node_invalid" in json.dumps(body)
        served = {(await infer(nc, policy="round_robin"))[1]["zml"]["node_id"] for _ in range(8)}
        assert served <= {"h100-a", "h100-b"}


async def test_node_goes_down_and_comes_back(fleet: Fleet) -> None:
    sim = fleet.sims["h100-a"]
    async with connect(fleet.nats_url) as nc:
        seen: list[str] = []

        async def record() -> bool:
            st = (await by_id(nc)).get("h100-a")
            if st and (not seen or seen[-1] != st.status):
                seen.append(st.status)
            return bool(st and st.status == "up" and len(seen) > 1)

        await sim.crash(for_s=1.0)  # back after 1 s, then reloads its model (0.2 s)
        await eventually(lambda: status_is(nc, {"h100-a": "down"}), timeout=5, what="down")
        down = (await by_id(nc))["h100-a"]
        assert down.consecutive_failures >= 3 and down.health_score == 0 and down.reason
        code, body = await infer(nc, accelerator_id="h100-a")
        assert code == "NO_HEALTHY_NODES", body
        code, body = await infer(nc)  # the fleet still serves
        assert code == "OK" and body["zml"]["node_id"] != "h100-a"
        await eventually(record, timeout=10, what="back up")
        assert seen[0] == "down" and seen[-1] == "up"
        code, body = await infer(nc, accelerator_id="h100-a")
        assert code == "OK", body


async def test_flapping_is_suppressed(fleet: Fleet) -> None:
    sim = fleet.sims["h100-b"]
    async with connect(fleet.nats_url) as nc:
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        watcher = await kv.watch("h100-b")
        statuses: set[str] = set()

        async def collect() -> None:
            async for entry in watcher:
                if entry is not None and entry.value:
                    statuses.add(json.loads(entry.value)["status"])

        task = asyncio.create_task(collect())
        for _ in range(3):  # three blips of ~1 failed probe each, fewer than down_after = 3
            await sim.crash(for_s=0.12)
            await asyncio.sleep(0.6)
        await asyncio.sleep(0.3)
        task.cancel()
        await watcher.stop()
        assert statuses == {"up"}, statuses


async def test_stale_state_is_not_routable_and_a_restart_recovers(fleet: Fleet) -> None:
    async with connect(fleet.nats_url) as nc:
        assert (await infer(nc))[0] == "OK"
        fleet.procs["health"].stop()  # nobody refreshes the node table now
        await asyncio.sleep(2.0)  # > [router] stale_after_s = 1.5
        code, body = await infer(nc)
        assert code == "NO_HEALTHY_NODES", body
        assert "state_stale" in json.dumps(body)
        fleet.procs["health"] = spawn("health", service_argv("health", fleet.config, fleet.nats_url))
        await eventually(lambda: status_is(nc, {"h100-a": "up", "h100-b": "up"}), timeout=20, what="fresh again")
        ages = [n.age_s for n in (await by_id(nc)).values() if n.status == "up"]
        assert ages and max(ages) < 1.0
        await eventually(lambda: _ok(nc), timeout=5, what="routable again")


async def _ok(nc: NATS) -> bool:
    return (await infer(nc))[0] == "OK"


async def test_runtime_registration_survives_restarts(fleet: Fleet) -> None:
    extra = await start_sim("mi300x-x", "amd_mi300x", [M])
    try:
        async with connect(fleet.nats_url) as nc:
            spec = NodeSpec(id="mi300x-x", accelerator="amd_mi300x", endpoint=extra.url, models=[M])
            added = await add_node(nc, spec, timeout=15)
            assert added.node == spec and not added.replaced
            with pytest.raises(BadRequestError, match="already registered"):
                await add_node(nc, spec, timeout=15)
            with pytest.raises(BadRequestError, match="unknown type 'nvidia_h200'"):
                await add_node(nc, NodeSpec(id="bad", accelerator="nvidia_h200", endpoint="http://x:1"), timeout=15)
            await eventually(lambda: status_is(nc, {"mi300x-x": "up"}), what="registered node up")
            assert (await by_id(nc))["mi300x-x"].source == "registry"
            code, body = await infer(nc, accelerator_id="mi300x-x")
            assert code == "OK", body
            # a zml.toml node removed at run time stays removed across a restart
            await remove_node(nc, "h100-fake", timeout=15)
            fleet.restart_health()
            await eventually(lambda: status_is(nc, {"mi300x-x": "up", "h100-a": "up"}), timeout=20, what="restarted")
            nodes = await by_id(nc)
            assert "h100-fake" not in nodes and nodes["mi300x-x"].source == "registry"
            await remove_node(nc, "mi300x-x", timeout=15)
            with pytest.raises(BadRequestError, match="no node 'mi300x-x'"):
                await remove_node(nc, "mi300x-x", timeout=15)
            assert "mi300x-x" not in await by_id(nc)

            # The routers hear of the removal from their watch of the node bucket, a moment after
            # the health service deleted the entry (a CI run's router still had it at once).
            async def refused() -> bool:
                code, _ = await infer(nc, accelerator_id="mi300x-x")
                return code != "OK"
            await eventually(refused, timeout=5, what="removed node no longer served")
    finally:
        await extra.stop()


async def test_model_not_loaded_says_what_to_do(fleet: Fleet) -> None:
    async with connect(fleet.nats_url) as nc:
        code, body = await infer(nc, model=COLD)
        assert code == "MODEL_NOT_LOADED", body
        assert "zml serve" in json.dumps(body)  # its nodes are up: `zml serve` loads it there
        # a model no node is configured for: no hint that cannot work
        code, body = await infer(nc, model="gpt-5")
        assert code == "MODEL_NOT_LOADED" and "zml serve" not in json.dumps(body), body
        assert body["error"]["message"].startswith("The model 'gpt-5' does not exist"), body
        # while a node loads it, still not routable there, and the answer says "loading"
        sim = fleet.sims["h100-a"]
        sim.engine.load(COLD)  # 2 s at time_scale 10: 0.2 s

        async def loading_seen() -> bool:
            st = (await by_id(nc)).get("h100-a")
            return bool(st and COLD in st.loading_models) or bool(st and COLD in st.models)
        await eventually(loading_seen, what="loading or loaded")
        await eventually(lambda: _ok_model(nc, COLD), timeout=5, what="routable once loaded")
        sim.engine.unload(COLD)


async def _ok_model(nc: NATS, model: str) -> bool:
    return (await infer(nc, model=model))[0] == "OK"
