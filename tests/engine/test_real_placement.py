"""Issue 32 on real engines: two llama-servers in router mode (``--models-dir`` with two GGUFs
of different sizes, ``--models-max 1``), the placement planner in apply mode. Demand is all for
one model; the planner moves it from the dearer node to the cheaper one (which first unloads
the model nobody asks for), through ``/models/load`` and ``/models/unload``, while a client
sends steadily and sees no error."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import nats
import pytest

import llamaserver
from enginefleet import Llama, llama  # noqa: F401
from zmlcore import subjects
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn

pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]

A, B = "zml/tiny-a", "zml/tiny-b"


def router_node(name: str, models: Path) -> tuple[str, Proc]:
    port = free_port()
    proc = spawn(name, [llamaserver.llama_server_binary() or "llama-server", "--models-dir", str(models),
                        "--models-max", "1", "--no-models-autoload", "--host", "127.0.0.1", "--port", str(port),
                        "--threads", "1", "--metrics"])
    url = f"http://127.0.0.1:{port}"
    llamaserver.wait_healthy(url, proc)
    return url, proc


def loaded(url: str) -> list[str]:
    data = httpx.get(url + "/models", timeout=5).json()["data"]
    return sorted(m["id"] for m in data if (m.get("status") or {}).get("value") == "loaded")


def wait_loaded(url: str, want: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while loaded(url) != want:
        assert time.monotonic() < deadline, (url, loaded(url), want)
        time.sleep(0.2)


def test_apply_moves_a_model_between_real_routers_without_an_error(llama: Llama, tmp_path: Path,  # noqa: F811
                                                                    own_nats: str) -> None:
    vocab = llamaserver.vocab_file()
    assert vocab is not None
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-a.gguf").symlink_to(llama.model)
    llamaserver.tiny_model(models / "tiny-b.gguf", vocab, seed=7, shape=llamaserver.SLOW)  # a larger model
    assert (models / "tiny-b.gguf").stat().st_size > (models / "tiny-a.gguf").stat().st_size
    dear_url, dear = router_node("llama-dear", models)
    cheap_url, cheap = router_node("llama-cheap", models)
    procs: list[Proc] = []
    try:
        httpx.post(dear_url + "/models/load", json={"model": "tiny-a"}, timeout=30).raise_for_status()
        httpx.post(cheap_url + "/models/load", json={"model": "tiny-b"}, timeout=30).raise_for_status()
        wait_loaded(dear_url, ["tiny-a"])
        wait_loaded(cheap_url, ["tiny-b"])
        nodes = "".join(
            f'[[nodes]]\nid = "{nid}"\naccelerator = "cpu"\nbackend = "llamacpp"\nendpoint = "{url}"\n'
            f'cost_per_hour = {price}\nmodels = ["{A}", "{B}"]\nstartup_grace_s = 5\n'
            f'[nodes.served_names]\n"{A}" = "tiny-a"\n"{B}" = "tiny-b"\n'
            for nid, url, price in (("llama-dear", dear_url, 0.4), ("llama-cheap", cheap_url, 0.2)))
        config = tmp_path / "zml.toml"
        config.write_text(f'[nats]\nurl = "{own_nats}"\n[health]\npoll_interval_s = 0.2\n'
                          f'[warmup]\nsweep_interval_s = 0.2\n'
                          f'[planner]\nmode = "apply"\ninterval_s = 1.0\nwindow_s = 6.0\ndrain_timeout_s = 20.0\n'
                          # three moves for $0.20/h: above the default move cost of $0.25/h each
                          f'move_cost_per_h = 0.05\n'
                          f'{nodes}')
        procs = [spawn(n, service_argv(n, str(config), own_nats)) for n in ("health", "warmup", "router")]
        for p in procs:
            assert p.wait_for("started", 30), p.tail()
        try:
            outcomes = asyncio.run(_drive(own_nats, cheap_url, dear_url))
        except AssertionError as exc:
            import subprocess
            import sys
            plan = subprocess.run([sys.executable, "-m", "zml.cli", "plan", "--json", "--config", str(config)],
                                  capture_output=True, text=True, timeout=30).stdout
            kv = subprocess.run([sys.executable, "-m", "zml.cli", "nodes", "--json", "--config", str(config)],
                                capture_output=True, text=True, timeout=30).stdout
            raise AssertionError(f"{exc}\n--- plan\n{plan}\n--- nodes\n{kv}") from None
        bad = [o for o in outcomes if o[0] != "OK"]
        assert not bad, (bad[:5], len(bad), len(outcomes))
        assert {n for _, n in outcomes} == {"llama-dear", "llama-cheap"}, {n for _, n in outcomes}
        assert loaded(cheap_url) == ["tiny-a"] and loaded(dear_url) == []
        print(f"{len(outcomes)} requests, 0 failed")
    finally:
        for p in reversed(procs):
            p.stop()
        dear.stop()
        cheap.stop()


async def _drive(url: str, cheap_url: str, dear_url: str) -> list[tuple[str, str]]:
    nc = await nats.connect(url)
    outcomes: list[tuple[str, str]] = []
    stop = asyncio.Event()

    async def one() -> None:
        body = {"model": A, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        try:
            msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=30)
            code = (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK")
            node = (json.loads(msg.data).get("zml") or {}).get("node_id", "")
        except Exception as exc:
            code, node = type(exc).__name__, ""
        outcomes.append((code, node))

    async def send() -> None:
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            t = asyncio.create_task(one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)

    try:
        # health has seen both nodes as they are (a request sent while it still guesses a node
        # in its start-up grace is "loading" everything would make llama-server autoload it)
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        deadline = time.monotonic() + 30
        while True:
            states = {}
            for nid in ("llama-dear", "llama-cheap"):
                try:
                    states[nid] = json.loads((await kv.get(nid)).value or b"{}")
                except Exception:
                    states[nid] = {}
            if (states["llama-dear"].get("status") == "up" and states["llama-dear"].get("models") == [A]
                    and states["llama-cheap"].get("status") == "up" and states["llama-cheap"].get("models") == [B]):
                break
            assert time.monotonic() < deadline, states
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 30
        while True:
            await one()
            if outcomes[-1][0] == "OK":
                break
            assert time.monotonic() < deadline, outcomes[-3:]
            await asyncio.sleep(0.3)
        outcomes.clear()
        sender = asyncio.create_task(send())
        deadline = time.monotonic() + 60
        while not (await asyncio.to_thread(loaded, cheap_url) == ["tiny-a"]
                   and await asyncio.to_thread(loaded, dear_url) == []):
            assert time.monotonic() < deadline, ("the planner did not move tiny-a to the cheap node",
                                                 loaded(cheap_url), loaded(dear_url), outcomes[-3:])
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        stop.set()
        await sender
    finally:
        stop.set()
        await nc.close()
    return outcomes
