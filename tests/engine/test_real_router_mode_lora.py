"""Issue 32 on a real engine: LoRA adapters per model in llama-server's router mode. One
llama-server with ``--models-dir`` (two GGUFs), ``--models-max 1`` and a ``--models-preset``
INI giving each model its own adapter GGUF (written by the test, ``llamaserver.tiny_lora``): each
model's instance numbers its adapters from 0, and ``/lora-adapters`` needs ``?model=``. Health
reads each model's ``--lora`` files from ``/v1/models`` (its launch arguments); a request for
an adapter is served, with that adapter applied, while its base model is loaded, and refused
(MODEL_NOT_LOADED) while the router holds the other model. With the planner in apply mode,
requests for the adapter of the model not loaded make it load that model (its adapter comes
with it) in place of the one nobody asks for."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

import llamaserver
from enginefleet import Llama, llama  # noqa: F401
from zmlcore import subjects
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn

pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]

A, B = "zml/tiny-a", "zml/tiny-b"
PIRATE, PARROT = "zml/tiny-a-pirate", "zml/tiny-b-parrot"
PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
MAX_TOKENS = 12


def direct(url: str, model: str, lora: list[dict[str, float]]) -> str:
    body: dict[str, Any] = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                            "lora": lora}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def load_only(url: str, model: str) -> None:
    httpx.post(url + "/models/load", json={"model": model}, timeout=30).raise_for_status()
    deadline = time.monotonic() + 60
    while True:
        data = httpx.get(url + "/models", timeout=5).json()["data"]
        if sorted(m["id"] for m in data if (m.get("status") or {}).get("value") == "loaded") == [model]:
            return
        assert time.monotonic() < deadline, data
        time.sleep(0.2)


def router_with_adapters(llama: Llama, tmp_path: Path) -> tuple[str, Proc, Path, Path]:  # noqa: F811
    """(url, process, pirate's GGUF, parrot's GGUF) of a router-mode llama-server, nothing loaded."""
    vocab = llamaserver.vocab_file()
    assert vocab is not None
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-a.gguf").symlink_to(llama.model)
    llamaserver.tiny_model(models / "tiny-b.gguf", vocab, seed=7)
    pirate = llamaserver.tiny_lora(tmp_path / "pirate.gguf", vocab)
    parrot = llamaserver.tiny_lora(tmp_path / "parrot.gguf", vocab, seed=11)
    preset = tmp_path / "preset.ini"
    preset.write_text(f"[tiny-a]\nlora = {pirate}\n\n[tiny-b]\nlora = {parrot}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn("llama-router", [llamaserver.llama_server_binary() or "llama-server", "--models-dir", str(models),
                                    "--models-preset", str(preset), "--models-max", "1", "--no-models-autoload",
                                    "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--metrics"])
    try:
        llamaserver.wait_healthy(url, server)
    except BaseException:
        server.stop()
        raise
    return url, server, pirate, parrot


def zml_config(own_nats: str, url: str, pirate: Path, parrot: Path, extra: str = "") -> str:
    return (f'[nats]\nurl = "{own_nats}"\n[health]\npoll_interval_s = 0.2\n{extra}'
            f'[adapters."{PIRATE}"]\nbase = "{A}"\npath = "{pirate}"\n'
            f'[adapters."{PARROT}"]\nbase = "{B}"\npath = "{parrot}"\n'
            f'[[nodes]]\nid = "llama-router"\naccelerator = "cpu"\nbackend = "llamacpp"\nendpoint = "{url}"\n'
            f'models = ["{A}", "{B}"]\nstartup_grace_s = 5\n'
            f'[nodes.served_names]\n"{A}" = "tiny-a"\n"{B}" = "tiny-b"\n')


def test_router_mode_adapters_are_read_per_model_and_served_with_their_own_ids(  # noqa: F811
        llama: Llama, tmp_path: Path, own_nats: str) -> None:
    url, server, pirate, parrot = router_with_adapters(llama, tmp_path)
    procs: list[Proc] = []
    try:
        load_only(url, "tiny-a")
        # what each adapter does, asked of llama-server itself: both are id 0 of their own model
        assert [a["id"] for a in httpx.get(url + "/lora-adapters", params={"model": "tiny-a"}).json()] == [0]
        pirate_says = direct(url, "tiny-a", [{"id": 0, "scale": 1.0}])
        assert pirate_says != direct(url, "tiny-a", [{"id": 0, "scale": 0.0}]), "the adapter changes nothing"
        config = tmp_path / "zml.toml"
        config.write_text(zml_config(own_nats, url, pirate, parrot))
        procs = [spawn(n, service_argv(n, str(config), own_nats)) for n in ("health", "router")]
        for p in procs:
            assert p.wait_for("started", 30), p.tail()
        asyncio.run(_drive(own_nats, url, pirate_says))
    finally:
        for p in reversed(procs):
            p.stop()
        server.stop()


async def _ask(nc: Any, model: str) -> tuple[str, str]:
    body = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=60)
    code = (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK")
    data = json.loads(msg.data)
    return (code, str(data["choices"][0]["message"]["content"]) if code == "OK" else "")


async def _state(nc: Any, want_models: list[str]) -> dict[str, Any]:
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    deadline = time.monotonic() + 30
    while True:
        try:
            st = json.loads((await kv.get("llama-router")).value or b"{}")
        except Exception:
            st = {}
        if st.get("status") == "up" and sorted(st.get("models", [])) == want_models:
            return st
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.2)


async def _drive(nats_url: str, url: str, pirate_says: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        st = await _state(nc, sorted([A, PIRATE]))
        assert st.get("adapters") == [PIRATE] and st.get("lora_ids") == {PIRATE: 0}, st
        got = [await _ask(nc, PIRATE) for _ in range(3)]
        assert got == [("OK", pirate_says)] * 3, (got, pirate_says)
        assert (await _ask(nc, PARROT))[0] == "MODEL_NOT_LOADED"  # its base is not loaded
        # the router swaps its one model: tiny-b's instance, with its own adapter as id 0
        await asyncio.to_thread(load_only, url, "tiny-b")
        parrot_says = await asyncio.to_thread(direct, url, "tiny-b", [{"id": 0, "scale": 1.0}])
        st = await _state(nc, sorted([B, PARROT]))
        assert st.get("adapters") == [PARROT] and st.get("lora_ids") == {PARROT: 0}, st
        assert (await _ask(nc, PARROT)) == ("OK", parrot_says)
        assert (await _ask(nc, PIRATE))[0] == "MODEL_NOT_LOADED"
    finally:
        await nc.close()


def test_the_planner_loads_the_model_whose_adapter_requests_ask_for(  # noqa: F811
        llama: Llama, tmp_path: Path, own_nats: str) -> None:
    url, server, pirate, parrot = router_with_adapters(llama, tmp_path)
    procs: list[Proc] = []
    try:
        load_only(url, "tiny-a")
        config = tmp_path / "zml.toml"
        config.write_text(zml_config(own_nats, url, pirate, parrot,
                                     '[warmup]\nsweep_interval_s = 0.2\n[planner]\nmode = "apply"\n'
                                     'interval_s = 1.0\nwindow_s = 5.0\ndrain_timeout_s = 10.0\n'
                                     'move_cost_per_h = 0.01\n'))
        procs = [spawn(n, service_argv(n, str(config), own_nats)) for n in ("health", "warmup", "router")]
        for p in procs:
            assert p.wait_for("started", 30), p.tail()
        codes = asyncio.run(_ask_until_served(own_nats))
        assert codes[-1] == "OK" and set(codes) <= {"OK", "MODEL_NOT_LOADED"}, codes
        data = httpx.get(url + "/models", timeout=5).json()["data"]
        assert [m["id"] for m in data if (m.get("status") or {}).get("value") == "loaded"] == ["tiny-b"]
    finally:
        for p in reversed(procs):
            p.stop()
        server.stop()


async def _ask_until_served(nats_url: str) -> list[str]:
    """Requests for the parrot adapter every 0.5 s until one is served (at most 60 s): refused
    while tiny-a is loaded, they are its demand; the planner loads tiny-b for them."""
    nc = await nats.connect(nats_url)
    codes: list[str] = []
    try:
        await _state(nc, sorted([A, PIRATE]))
        st = await _state(nc, sorted([A, PIRATE]))
        assert st.get("model_adapters") == {A: [PIRATE], B: [PARROT]}, st
        deadline = time.monotonic() + 60
        while not codes or codes[-1] != "OK":
            assert time.monotonic() < deadline, codes[-5:]
            codes.append((await _ask(nc, PARROT))[0])
            await asyncio.sleep(0.5)
    finally:
        await nc.close()
    return codes
