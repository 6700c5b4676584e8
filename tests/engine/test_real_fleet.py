"""Two real llama-server nodes (the tiny generated llama, CPU family) in a ZML fleet beside two
sims: health as the health service sees them, pinned and policy-routed requests, streaming
through the openai client, a node killed under load, and its return."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from enginefleet import EMBED, EMBED_SERVED, SERVED, EngineFleet, engine_fleet, llama  # noqa: F401
from conftest import MODEL

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

PROMPT = [{"role": "user", "content": "Tell me a story about routers."}]


def test_real_nodes_are_up_with_the_engines_capacity(engine_fleet: EngineFleet) -> None:
    nodes = engine_fleet.nodes()
    for node_id in ("llama-1", "llama-2"):
        n = nodes[node_id]
        assert n["status"] == "up" and n["backend"] == "llamacpp", n
        assert (n["accelerator_type"], n["family"]) == ("cpu", "CPU")
        assert n["models"] == [MODEL] and n["served_names"] == {MODEL: SERVED}
        assert n["max_concurrency"] == 4  # /props total_slots (--parallel 4), not the type's default
        assert n["health_score"] > 0
    assert {nodes[s]["status"] for s in ("h100-1", "a100-1")} == {"up"}


def test_pinned_requests_reach_the_real_node(engine_fleet: EngineFleet) -> None:
    for node_id in ("llama-1", "llama-2"):
        r = engine_fleet.chat(accelerator_id=node_id, max_tokens=12)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["zml"]["node_id"] == node_id
        assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["message"]["content"]


def test_policy_routes_to_the_cpu_family_or_away_from_it(engine_fleet: EngineFleet) -> None:
    cpu = {engine_fleet.chat(policy="cpu-only", max_tokens=4).json()["zml"]["node_id"] for _ in range(6)}
    assert cpu <= {"llama-1", "llama-2"} and cpu, cpu
    gpu = {engine_fleet.chat(policy="gpu-only", max_tokens=4).json()["zml"]["node_id"] for _ in range(4)}
    assert gpu <= {"h100-1", "a100-1"} and gpu, gpu


def test_measured_speeds_replace_the_cpu_types_guess(engine_fleet: EngineFleet) -> None:
    # Enough tokens through each real node for the speed meter (64-token windows): long prompts,
    # each different (llama-server reuses a cached prompt prefix and counts only new tokens).
    def one(i: int) -> httpx.Response:
        text = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(120))
        return engine_fleet.chat(accelerator_id=f"llama-{i % 2 + 1}", max_tokens=96, content=text)

    with ThreadPoolExecutor(4) as pool:
        for r in pool.map(one, range(12)):
            assert r.status_code == 200, r.text
    for node_id in ("llama-1", "llama-2"):
        n = engine_fleet.wait_node(node_id, lambda n: n["speeds_measured"], timeout=30, what="speeds measured")
        # The cpu type's table says prefill 500, decode 3 tokens/s: the tiny model is far faster.
        assert n["decode_tps"] > 50 and n["prefill_tps"] > 500, n
    # and the engine's own view agrees with what health publishes (same counters, same order)
    m = httpx.get(engine_fleet.real["llama-1"].url + "/metrics", timeout=5).text
    assert "llamacpp:tokens_predicted_seconds_total" in m and "llamacpp:prompt_seconds_total" in m


def test_streaming_through_the_openai_client_matches_the_engine(engine_fleet: EngineFleet) -> None:
    params = {"max_tokens": 48, "temperature": 0.0, "seed": 7}
    direct = httpx.post(engine_fleet.real["llama-1"].url + "/v1/chat/completions",
                        json={"model": SERVED, "messages": PROMPT, **params}, timeout=60).json()
    client = openai.OpenAI(base_url=engine_fleet.stack.gateway_url + "/v1", api_key="unused", timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=PROMPT, stream=True,  # type: ignore[arg-type]
                                            extra_body={"accelerator_id": "llama-1"}, **params)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text and text == direct["choices"][0]["message"]["content"]


def test_a_node_killed_under_load_loses_nothing_and_comes_back(engine_fleet: EngineFleet) -> None:
    victim = engine_fleet.real["llama-2"]

    def one(i: int) -> httpx.Response:
        return engine_fleet.chat(policy="cpu-only", max_tokens=64, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(24)]
        time.sleep(1.0)  # some requests are running on llama-2 now
        victim.kill()
        results = [f.result() for f in futures]
    bad = [r.text for r in results if r.status_code != 200]
    assert not bad, bad
    assert {r.json()["zml"]["node_id"] for r in results} <= {"llama-1", "llama-2"}
    engine_fleet.wait_node("llama-2", lambda n: n["status"] == "down", timeout=30, what="down")
    # while it is down, work goes to llama-1
    assert engine_fleet.chat(policy="cpu-only", max_tokens=4).json()["zml"]["node_id"] == "llama-1"
    # restart on the same port: back up, and served again
    victim.start(engine_fleet.llama)
    engine_fleet.wait_node("llama-2", lambda n: n["status"] == "up", timeout=60, what="up again")
    r = engine_fleet.chat(accelerator_id="llama-2", max_tokens=4)
    assert r.status_code == 200 and r.json()["zml"]["node_id"] == "llama-2", r.text



def test_embeddings_from_a_real_llama_server_through_the_gateway(engine_fleet: EngineFleet) -> None:
    inputs = ["a cat sat on the mat", "routing requests to accelerators"]
    client = openai.OpenAI(base_url=engine_fleet.stack.gateway_url + "/v1", api_key="unused", timeout=60)
    got = client.embeddings.create(model=EMBED, input=inputs)
    direct = httpx.post(engine_fleet.real["llama-embed"].url + "/v1/embeddings",
                        json={"model": EMBED_SERVED, "input": inputs}, timeout=60).json()
    assert [d.index for d in got.data] == [0, 1]
    want = [d["embedding"] for d in sorted(direct["data"], key=lambda d: d["index"])]
    assert len(want[0]) == 64  # the tiny llama's width
    for g, w in zip(got.data, want):
        assert g.embedding == pytest.approx(w, abs=1e-6)
    assert got.data[0].embedding != got.data[1].embedding
    raw = httpx.post(engine_fleet.stack.gateway_url + "/v1/embeddings", json={"model": EMBED, "input": "x"},
                     timeout=60)
    assert raw.status_code == 200 and raw.json()["zml"]["node_id"] == "llama-embed", raw.text


def test_loading_until_the_engine_answers_then_up_then_down(engine_fleet: EngineFleet) -> None:
    late = engine_fleet.late
    assert late is not None
    st = engine_fleet.nodes()["llama-late"]
    assert st["status"] == "loading" and MODEL in st["loading_models"], st  # in its start-up grace window
    late.start(engine_fleet.llama)
    try:
        st = engine_fleet.wait_node("llama-late", lambda n: n["status"] == "up", timeout=30, what="up")
        assert st["models"] == [MODEL] and not st.get("loading_models")
        r = engine_fleet.chat(accelerator_id="llama-late", max_tokens=4)
        assert r.status_code == 200, r.text
    finally:
        late.stop()
    st = engine_fleet.wait_node("llama-late", lambda n: n["status"] == "down", timeout=30, what="down")
    assert "llama.cpp probe" in st["reason"] or "ConnectError" in st["reason"], st
