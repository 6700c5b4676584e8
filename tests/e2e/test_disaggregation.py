"""Disaggregated prefill/decode through the whole stack (gateway, router, health, sim nodes
speaking vLLM's KV-connector protocol): a long prompt is prefilled on the prefill node and
decoded on the decode node from the pulled blocks, as one answer, streamed or not, the legs
named in the routing metadata; a short one is served whole; a failed prefill leg (an error, or
its node lost mid-leg) is run again on the other prefill node for the same decode node, and when
that fails too the request is served whole on the decode node; the reply says which."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import MODEL, Stack, launch_stack

PREFILL = ("pf-1", "nvidia_h100", [MODEL], 'roles = ["prefill"]\nkv_group = "g"\nkv_gbps = 400\n')
DECODE = ("dec-1", "intel_gaudi2", [MODEL], 'roles = ["decode"]\nkv_group = "g"\nkv_gbps = 400\n')
# a second prefill node, far slower (a CPU): the decider prefers pf-1 whenever it can take the leg
PREFILL2 = ("pf-2", "cpu", [MODEL], 'roles = ["prefill"]\nkv_group = "g"\nkv_gbps = 400\n')
def long_prompt(topic: str) -> str:
    """~6,000 tokens, a new prompt per topic (no node holds any of it yet)."""
    return f"Summarise the {topic} report in one line. " + f"The {topic} figures rose again. " * 650


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # always: sims at time_scale 20 measure 20x their model speeds while a link's time is real,
    # so whether a split pays wavers with the measured speeds; the decision's logic is
    # tests/unit/test_split_decide.py's, the legs are this module's
    # (min_uncached_tokens 2048: a follow-up turn leaves less than that uncached where it was decoded)
    extra = "[disaggregation]\nenabled = true\nalways = true\nmin_uncached_tokens = 2048\n"
    s = launch_stack(own_nats, tmp_path_factory.mktemp("disagg"), fleet=[PREFILL, PREFILL2, DECODE], routers=1,
                     extra=extra)
    try:
        wait_up(s, "pf-1", "pf-2", "dec-1")
        yield s
    finally:
        s.stop()


def wait_up(stack: Stack, *nodes: str) -> None:
    """Until every node is up as the fleet sees it (a prefill-only node is no condition of the
    stack's readiness: it serves no whole request)."""
    deadline = time.monotonic() + 20
    while True:
        rows = {n["node_id"]: n for n in httpx.get(stack.gateway_url + "/v1/nodes", timeout=5).json()["nodes"]}
        if all(rows.get(n, {}).get("status") == "up" and rows[n].get("models") for n in nodes):
            time.sleep(0.5)  # and the router's table, fed by the same bucket
            return
        assert time.monotonic() < deadline, rows
        time.sleep(0.1)


def chat(stack: Stack, content: str, **kw: object) -> httpx.Response:
    return httpx.post(stack.gateway_url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw})


def sim_faults(stack: Stack, node: str, faults: dict[str, object] | None) -> None:
    url = f"http://127.0.0.1:{stack.node_ports[node]}/sim/faults"
    r = httpx.post(url, json=faults, timeout=5) if faults else httpx.delete(url, timeout=5)
    assert r.status_code == 200, r.text


def test_a_long_prompt_is_prefilled_on_one_node_and_decoded_on_the_other(stack: Stack) -> None:
    r = chat(stack, long_prompt("quarterly"))
    assert r.status_code == 200, r.text
    body = r.json()
    z = body["zml"]
    assert z["node_id"] == "dec-1" and z["prefill_node"] == "pf-1" and z["prefill_ms"] > 0
    assert "prefill_failed" not in z or z["prefill_failed"] is None
    assert r.headers["x-zml-prefill-node"] == "pf-1"
    usage = body["usage"]
    # the decode leg computed almost nothing: the prompt's blocks came from the prefill node
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]
    assert usage["completion_tokens"] == 8 and "[dec-1]" in body["choices"][0]["message"]["content"]


def test_streamed_as_one_answer(stack: Stack) -> None:
    with httpx.stream("POST", stack.gateway_url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt("annual")}],
                            "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["x-zml-prefill-node"] == "pf-1" and r.headers["x-zml-node-id"] == "dec-1"
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == 8 and text.count("[dec-1]") >= 1
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]


def test_a_short_prompt_is_served_whole(stack: Stack) -> None:
    r = chat(stack, "Hello there")
    assert r.status_code == 200, r.text
    z = r.json()["zml"]
    assert z["node_id"] == "dec-1" and not z.get("prefill_node")


def test_the_next_turn_stays_on_the_decode_node_that_holds_the_conversation(stack: Stack) -> None:
    # The first turn was split and decoded on dec-1, which now holds its prompt: the next turn
    # has little left to prefill there (under min_uncached_tokens), and is served whole.
    first = long_prompt("weekly")
    r = chat(stack, first)
    assert r.json()["zml"]["prefill_node"] == "pf-1"
    r = chat(stack, first + " And the daily ones?")
    z = r.json()["zml"]
    assert z["node_id"] == "dec-1" and not z.get("prefill_node") and z["cached_tokens_estimated"] > 3000


def cooled_down() -> None:
    """A node that failed is skipped for the stack's [router] cooldown_s (2 s): let it pass, so
    the next test finds pf-1 preferred again."""
    time.sleep(2.5)


def test_a_failed_prefill_leg_is_run_again_on_the_other_prefill_node(stack: Stack) -> None:
    sim_faults(stack, "pf-1", {"error_rate": 1.0})
    try:
        r = chat(stack, long_prompt("monthly"))
        assert r.status_code == 200, r.text
        body = r.json()
        z = body["zml"]
        assert z["node_id"] == "dec-1" and z["prefill_node"] == "pf-2" and z["prefill_failed"] == "pf-1:server"
        assert r.headers["x-zml-prefill-failed"] == "pf-1:server" and r.headers["x-zml-prefill-node"] == "pf-2"
        usage = body["usage"]  # decoded from pf-2's blocks: nothing recomputed
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]
    finally:
        sim_faults(stack, "pf-1", None)
        cooled_down()


def test_when_both_prefill_legs_fail_the_request_is_served_whole_on_the_decode_node(stack: Stack) -> None:
    for node in ("pf-1", "pf-2"):
        sim_faults(stack, node, {"error_rate": 1.0})
    try:
        r = chat(stack, long_prompt("yearly"))
        assert r.status_code == 200, r.text
        z = r.json()["zml"]
        assert z["node_id"] == "dec-1" and not z.get("prefill_node")
        assert z["prefill_failed"] == "pf-1:server,pf-2:server"
        assert r.headers["x-zml-prefill-failed"] == "pf-1:server,pf-2:server"
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        for node in ("pf-1", "pf-2"):
            sim_faults(stack, node, None)
        cooled_down()


def test_a_prefill_node_lost_mid_leg_hands_the_leg_to_the_other(stack: Stack) -> None:
    """pf-1 slowed so its leg takes ~1.5 s, then crashed 0.5 s into it (connections dropped,
    back 2 s later): the leg goes to pf-2, the answer comes from dec-1 with pf-2's blocks."""
    sim_faults(stack, "pf-1", {"slowdown": 50.0})
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", chat(stack, long_prompt("hourly"))))
    t.start()
    try:
        time.sleep(0.5)
        sim_faults(stack, "pf-1", {"slowdown": 50.0, "crash": True, "crash_for_s": 2.0})
        t.join(30)
        r = box["r"]
        assert r.status_code == 200, r.text
        body = r.json()
        z = body["zml"]
        assert z["node_id"] == "dec-1" and z["prefill_node"] == "pf-2" and z["prefill_failed"] == "pf-1:network", z
        usage = body["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]
        assert usage["completion_tokens"] == 8
    finally:
        t.join(30)
        deadline = time.monotonic() + 15  # back up: its faults cleared
        while True:
            try:
                sim_faults(stack, "pf-1", None)
                break
            except (httpx.HTTPError, AssertionError):
                assert time.monotonic() < deadline
                time.sleep(0.3)
