"""Issue 32 on real engines: a LoRA adapter on llama.cpp. Two llama-servers of the tiny model,
one started with ``--lora`` of an adapter GGUF the test writes (``llamaserver.tiny_lora``), one
without. Health reads the adapter from ``GET /lora-adapters``; a request naming the adapter goes
only to the node that holds it and is answered with the adapter applied (the same tokens as a
request to that server with ``"lora": [{"id": 0, "scale": 1}]``, other tokens than the base
model's); a request for the base model on that node is answered by the base weights although
the server's global scale for the adapter is 1.0 (ZML turns it off per request); and the
planner keeps the base model on that node, with the adapter, while the adapter has demand
although a cheaper node could serve the base alone (llama-server loads no adapter after start)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest

import llamaserver
from enginefleet import SERVED, Llama, llama  # noqa: F401
from zmlcore import subjects
from zmlcore.messages.placement import PlanRequest, plan_reply_decoder
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn

pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]

BASE = "zml/tiny"
ADAPTER = "zml/tiny-pirate"
PROMPT = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
MAX_TOKENS = 12


def direct(url: str, lora: list[dict[str, float]] | None) -> str:
    """The reply of one llama-server, asked directly (greedy)."""
    body: dict[str, Any] = {"model": SERVED, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if lora is not None:
        body["lora"] = lora
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def test_an_adapter_request_goes_where_llama_server_holds_it_and_is_served_with_it(
        llama: Llama, tmp_path: Path, own_nats: str) -> None:  # noqa: F811
    vocab = llamaserver.vocab_file()
    assert vocab is not None
    adapter = llamaserver.tiny_lora(tmp_path / "pirate.gguf", vocab)
    lora_port, plain_port = free_port(), free_port()
    lora_node = llamaserver.start_server("llama-lora", llama.binary, llama.model, lora_port, "--lora", str(adapter),
                                         alias=SERVED)
    plain_node = llamaserver.start_server("llama-plain", llama.binary, llama.model, plain_port, alias=SERVED)
    lora_url, plain_url = f"http://127.0.0.1:{lora_port}", f"http://127.0.0.1:{plain_port}"
    procs: list[Proc] = []
    try:
        llamaserver.wait_healthy(lora_url, lora_node)
        llamaserver.wait_healthy(plain_url, plain_node)
        listed = httpx.get(lora_url + "/lora-adapters", timeout=10).json()
        assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, str(adapter), 1.0)], listed
        # what the adapter does, asked of llama-server itself
        with_adapter = direct(lora_url, [{"id": 0, "scale": 1.0}])
        without = direct(lora_url, [{"id": 0, "scale": 0.0}])
        assert with_adapter != without, "the adapter changes nothing: make its deltas larger"
        assert direct(plain_url, None) == without  # the same base weights on both nodes
        # (a request without "lora" runs at the global scales, 1.0 here, but llama-server clears
        # a slot's prompt cache only when a request's own list differs from the slot's: ZML
        # always sends the list to a node holding adapters)

        nodes = "".join(
            f'[[nodes]]\nid = "{nid}"\naccelerator = "cpu"\nbackend = "llamacpp"\nendpoint = "{url}"\n'
            f'cost_per_hour = {price}\nmodels = ["{BASE}"]\nstartup_grace_s = 5\n'
            f'[nodes.served_names]\n"{BASE}" = "{SERVED}"\n'
            for nid, url, price in (("llama-lora", lora_url, 0.4), ("llama-plain", plain_url, 0.2)))
        config = tmp_path / "zml.toml"
        config.write_text(f'[nats]\nurl = "{own_nats}"\n[health]\npoll_interval_s = 0.2\n'
                          f'[warmup]\nsweep_interval_s = 0.2\n'
                          f'[planner]\nmode = "advise"\ninterval_s = 1.0\nwindow_s = 30.0\nmove_cost_per_h = 0.01\n'
                          f'[adapters."{ADAPTER}"]\nbase = "{BASE}"\npath = "{adapter}"\n'
                          f'{nodes}')
        procs = [spawn(n, service_argv(n, str(config), own_nats)) for n in ("health", "warmup", "router")]
        for p in procs:
            assert p.wait_for("started", 30), p.tail()
        report = asyncio.run(_drive(own_nats, plain_node, with_adapter, without))
        print(report)
    finally:
        for p in reversed(procs):
            p.stop()
        lora_node.stop()
        plain_node.stop()


async def _ask(nc: Any, model: str) -> tuple[str, str, str, str]:
    """(error code or OK, node, content, model in the reply) of one request through ZML."""
    body = {"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=60)
    code = (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK")
    data = json.loads(msg.data)
    if code != "OK":
        return code, "", str(data)[:200], ""
    return (code, (data.get("zml") or {}).get("node_id", ""), str(data["choices"][0]["message"]["content"]),
            str(data.get("model", "")))


async def _node(kv: Any, nid: str) -> dict[str, Any]:
    try:
        return json.loads((await kv.get(nid)).value or b"{}")
    except Exception:
        return {}


async def _drive(url: str, plain_node: Proc, with_adapter: str, without: str) -> str:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        deadline = time.monotonic() + 30
        while True:  # health has read the adapter from the node that holds it
            lora, plain = await _node(kv, "llama-lora"), await _node(kv, "llama-plain")
            if (lora.get("status") == "up" and plain.get("status") == "up"
                    and sorted(lora.get("models", [])) == [BASE, ADAPTER]):
                break
            assert time.monotonic() < deadline, (lora, plain)
            await asyncio.sleep(0.2)
        assert lora.get("adapters") == [ADAPTER] and lora.get("lora_ids") == {ADAPTER: 0}
        assert lora.get("lora_count") == 1
        assert plain.get("models") == [BASE] and not plain.get("adapters") and not plain.get("lora_count")

        # adapter requests, three at a time: each on the node holding it, with it applied
        got: list[tuple[str, str, str, str]] = []
        for _ in range(4):
            got += await asyncio.gather(*(_ask(nc, ADAPTER) for _ in range(3)))
        assert all(g[0] == "OK" for g in got), got
        assert {g[1] for g in got} == {"llama-lora"}, got
        assert {g[2] for g in got} == {with_adapter}, (got, with_adapter)
        assert {g[3] for g in got} == {ADAPTER}, got  # the name the client asked for

        # the planner, advised: the base stays on the dearer node, which alone holds the adapter
        rep = plan_reply_decoder.decode((await nc.request(
            subjects.WARMUP_PLAN, msgspec.json.encode(PlanRequest(fresh=True)), timeout=30)).data)
        assert rep.adapters_plan.get("llama-lora") == [ADAPTER], rep
        plan_nodes = {m.model: m.nodes_plan for m in rep.models}
        assert "llama-lora" in plan_nodes.get(BASE, []), rep

        # base requests on the node that holds the adapter (the other one stopped): the base's
        # tokens, although the server's global scale for the adapter is 1.0
        plain_node.stop()
        deadline = time.monotonic() + 30
        while (await _node(kv, "llama-plain")).get("status") == "up":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        base = [await _ask(nc, BASE) for _ in range(4)]
        assert all(b[0] == "OK" and b[1] == "llama-lora" for b in base), base
        assert {b[2] for b in base} == {without}, (base, without)
        # and the adapter still goes there, with it applied
        again = await _ask(nc, ADAPTER)
        assert again[:3] == ("OK", "llama-lora", with_adapter), again
        return (f"{len(got)} adapter requests, all on llama-lora with the adapter applied; "
                f"{len(base)} base requests there with it off; plan keeps {BASE} on {plan_nodes.get(BASE)}")
    finally:
        await nc.close()
