"""The placement planner on a live stack (health, warmup, router as processes; llama.cpp sim
nodes in router mode): in apply mode it moves a model from an expensive node to a cheap idle
one, make before break, while a client sends steadily and sees no error; in advise mode
`zml plan` shows the same moves and nothing moves."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_health_helpers import SimNode, eventually, start_sim  # noqa: E402

from zmlcore import subjects  # noqa: E402
from zmlcore.runtime.launch import Proc, service_argv, spawn  # noqa: E402

A = "model-a"
B = "model-b"


@pytest.fixture(scope="module")
def nats_url(own_nats: str) -> str:
    return own_nats


async def start_stack(nats_url: str, folder: Path, mode: str) -> tuple[str, list[SimNode], list[Proc]]:
    sims = [await start_sim(f"{mode}-big", "nvidia_h100", [A], time_scale=10.0, load_time_s=2.0, engine="llamacpp"),
            await start_sim(f"{mode}-small-1", "nvidia_a100", [B], time_scale=10.0, load_time_s=2.0,
                            engine="llamacpp"),
            await start_sim(f"{mode}-small-2", "nvidia_a100", [], time_scale=10.0, load_time_s=2.0,
                            engine="llamacpp")]
    nodes = "\n".join(f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "{s.accelerator}"\nendpoint = "{s.url}"\n'
                      f'backend = "llamacpp"\nmodels = ["{A}", "{B}"]\n' for s in sims)
    path = folder / "zml.toml"
    path.write_text(f'[nats]\nurl = "{nats_url}"\n[health]\npoll_interval_s = 0.1\nstartup_grace_s = 1.0\n'
                    f'[warmup]\nsweep_interval_s = 0.2\n'
                    f'[planner]\nmode = "{mode}"\ninterval_s = 1.0\nwindow_s = 5.0\ndrain_timeout_s = 10.0\n{nodes}')
    procs = [spawn(name, service_argv(name, str(path), nats_url)) for name in ("health", "warmup", "router")]
    for p in procs:
        assert await asyncio.to_thread(p.wait_for, "started", 20), p.tail()
    return str(path), sims, procs


async def stop_stack(sims: list[SimNode], procs: list[Proc]) -> None:
    for p in procs:  # all signalled, then waited for: their drains overlap (tests/conftest.py, Stack.stop)
        p.terminate()
    for p in reversed(procs):
        p.stop()
    for s in sims:
        await s.stop()


async def infer(nc: nats.NATS, model: str) -> tuple[str, dict]:  # type: ignore[type-arg]
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=15)
    return (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK"), json.loads(msg.data)


async def zml_plan(config: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "zml.cli", "plan", "--config", config, *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()
    return out.decode()


class Client:
    """Sends requests for both models steadily and keeps every outcome."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.outcomes: list[tuple[str, str, str]] = []  # (model, code, node)
        self.stop = asyncio.Event()

    async def run(self, model: str, every_s: float) -> None:
        async def one() -> None:
            try:
                code, body = await infer(self.nc, model)
            except Exception as exc:  # a timeout is a dropped request too
                code, body = type(exc).__name__, {}
            self.outcomes.append((model, code, (body.get("zml") or {}).get("node_id", "")))

        pending: set[asyncio.Task[None]] = set()
        while not self.stop.is_set():
            t = asyncio.create_task(one())
            pending.add(t)
            t.add_done_callback(pending.discard)
            await asyncio.sleep(every_s)
        await asyncio.gather(*pending)


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_url)
    try:
        yield Client(nc)
    finally:
        await nc.close()


async def test_apply_moves_a_model_to_a_cheaper_node_without_dropping_a_request(
        nats_url: str, tmp_path: Path, client: Client) -> None:
    config, sims, procs = await start_stack(nats_url, tmp_path, "apply")
    big, small1, small2 = sims
    try:
        async def both_up() -> bool:
            return (await infer(client.nc, A))[0] == "OK" and (await infer(client.nc, B))[0] == "OK"

        await eventually(both_up, timeout=20, what="fleet serving")
        senders = [asyncio.create_task(client.run(A, 0.05)), asyncio.create_task(client.run(B, 0.1))]
        t0 = time.monotonic()
        # A leaves the $4/h node for the idle $2/h one: loaded there first, unloaded here after
        try:
            await eventually(lambda: not big.engine.models and A in small2.engine.models, timeout=40,
                             what="model-a moved to the cheap node")
        except AssertionError:
            kv = await client.nc.jetstream().key_value(subjects.NODES_BUCKET)
            states = [(await kv.get(s.node_id)).value for s in sims]
            raise AssertionError(procs[1].tail()[-3000:] + "\n" + await zml_plan(config) + repr(states)) from None
        moved_s = time.monotonic() - t0
        await asyncio.sleep(1.0)  # requests after the move, on the new node
        client.stop.set()
        await asyncio.gather(*senders)
        bad = [o for o in client.outcomes if o[1] != "OK"]
        assert not bad, (bad[:5], len(bad), len(client.outcomes))
        served_a = {node for m, _, node in client.outcomes if m == A}
        assert served_a == {big.node_id, small2.node_id}, served_a
        assert B in small1.engine.models
        assert len(client.outcomes) > 100, len(client.outcomes)
        out = await zml_plan(config)
        assert "planner mode apply: $4.00/h now, $4.00/h planned (0 move(s)" in out, out
        assert f"{A}" in out and f"{small2.node_id} -> {small2.node_id}" in out, out
        print(f"moved in {moved_s:.1f} s under load, {len(client.outcomes)} requests, 0 failed")
    finally:
        client.stop.set()
        await stop_stack(sims, procs)


async def test_advise_shows_the_moves_and_moves_nothing(nats_url: str, tmp_path: Path, client: Client) -> None:
    config, sims, procs = await start_stack(nats_url, tmp_path, "advise")
    big, small1, small2 = sims
    try:
        async def serving() -> bool:
            return (await infer(client.nc, A))[0] == "OK" and (await infer(client.nc, B))[0] == "OK"

        await eventually(serving, timeout=20, what="fleet serving")
        senders = [asyncio.create_task(client.run(A, 0.1)), asyncio.create_task(client.run(B, 0.2))]

        async def planned() -> str | None:
            out = await zml_plan(config, "--fresh")
            return out if "move(s)" in out and "load model-a" in out else None

        out = await eventually(planned, timeout=20, interval=0.5, what="a plan with moves")
        assert "planner mode advise: $6.00/h now, $4.00/h planned (2 move(s)" in out, out
        assert f"load model-a on {small2.node_id}" in out and f"unload model-a on {big.node_id}" in out, out
        assert f"release: 1 H100 node(s) idle in the plan ({big.node_id})" in out, out
        js = json.loads(await zml_plan(config, "--json"))
        assert js["mode"] == "advise" and js["cost_plan_per_h"] == 4.0
        await asyncio.sleep(2.0)
        assert A in big.engine.models and not small2.engine.models and not small2.engine.loading
        client.stop.set()
        await asyncio.gather(*senders)
        assert all(code == "OK" for _, code, _ in client.outcomes)
    finally:
        client.stop.set()
        await stop_stack(sims, procs)
