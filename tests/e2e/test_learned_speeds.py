"""Issue 28 through the whole stack (sims, health, router, gateway as processes): two llama.cpp
sims 5x faster than the `cpu` type says (hidden: [nodes.sim] true_speed) are measured from a
cold start by health's calibration requests; the reply says what the learned speeds predicted;
the inter-token deadline follows the learned speeds instead of the fixed 10 s."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conftest import MODEL, Stack, launch_stack

FLEET = [
    ("cpu-a", "cpu", [MODEL], 'backend = "llamacpp"\n'),
    ("cpu-b", "cpu", [MODEL], 'backend = "llamacpp"\n'),
]
#: told 1,500 / 75 tokens/s (the cpu type); really 5x that
TRUE_PREFILL, TRUE_DECODE = 7_500.0, 375.0


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("learn"), fleet=FLEET, routers=1, poll_s=0.3, time_scale=1.0,
                     sim_extra="true_speed = 5.0\n", router="cooldown_s = 2\n")
    try:
        yield s
    finally:
        s.stop()


def _nodes(stack: Stack) -> dict[str, dict[str, Any]]:
    r = httpx.get(stack.gateway_url + "/v1/nodes", timeout=10)
    assert r.status_code == 200, r.text
    return {n["node_id"]: n for n in r.json()["nodes"]}


def _learned(stack: Stack, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    nodes: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        nodes = _nodes(stack)
        if all(n.get("speeds_source") == "measured" and (n.get("speeds_confidence") or 0) > 0.5
               for n in nodes.values()) and len(nodes) == 2:
            return nodes
        time.sleep(0.2)
    raise AssertionError(f"speeds not learned within {timeout:g} s: {nodes}")


def test_cold_nodes_are_measured_not_assumed(stack: Stack) -> None:
    nodes = _learned(stack)
    for n in nodes.values():
        # 5x off the type's guess before; within 25% in tests/integration/test_speed_learning.py,
        # 50% here where four processes share a loaded box with the sims' clocks
        assert abs(n["prefill_tps"] / TRUE_PREFILL - 1) < 0.5, n["prefill_tps"]
        assert abs(n["decode_tps"] / TRUE_DECODE - 1) < 0.5, n["decode_tps"]
        assert n["model_speeds"][MODEL]["source"] == "measured"


async def _stream(stack: Stack, body: dict[str, Any]) -> tuple[httpx.Headers, list[Any], float]:
    events: list[Any] = []
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, "stream": True, **body}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            return r.headers, events, time.monotonic() - t0


async def test_reply_says_what_the_learned_speeds_predicted(stack: Stack) -> None:
    _learned(stack)
    prompt = "x" * 12_000  # ~3,000 tokens as the sim counts them: ~0.4 s of prefill really
    headers, events, _ = await _stream(stack, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8})
    # a stream's routing metadata is in its headers (the zml object is a plain reply's)
    predicted = float(headers["x-zml-predicted-ttft-ms"])
    assert float(headers["x-zml-predicted-tpot-ms"]) > 0
    assert events[-1] == "[DONE]"
    observed_ms = float(headers["x-zml-time-to-first-token"]) * 1000
    # learned, not the type's guess (which predicts 5x longer): within 2x on a loaded box
    assert 0.5 < observed_ms / predicted < 2.0, (observed_ms, predicted)


async def test_stall_deadline_follows_learned_speeds(stack: Stack) -> None:
    """Fast nodes: the deadline is the 1 s floor, so a stall pinned on one node (nowhere to
    continue) ends in about 1-2 s, where the fixed [router] inter_token_timeout_s took 10-20."""
    _learned(stack)
    stack.faults("cpu-a", stall_mid_stream=1.0, fail_after_tokens=3)
    try:
        _, events, took = await _stream(stack, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                                                "accelerator_id": "cpu-a"})
    finally:
        stack.faults("cpu-a", stall_mid_stream=0.0, fail_after_tokens=1)
    assert any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert took < 5.0, took
