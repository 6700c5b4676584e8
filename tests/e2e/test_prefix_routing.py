"""Cache-aware routing through the whole stack (issue 19), on simulated nodes with prefix caches:
two routers, the health service bridging two nodes' vLLM-format KV events, conversations of
several turns over HTTP. Follow-up turns reach the node that holds their conversation, which
reports the prefix cached; the reply says the router's estimate and the engine's report; a
session (x-session-id) keeps short prompts on one node; /v1/nodes and the routers' /metrics
show it."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest

from conftest import MODEL, Stack, launch_stack, wait_ready
from zmlcore import subjects
from zmlcore.runtime.launch import free_port

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def _node(node_id: str, acc: str, events: bool) -> str:
    out = (f'[[nodes]]\nid = "{node_id}"\naccelerator = "{acc}"\nendpoint = "http://127.0.0.1:{free_port()}"\n'
           f'models = ["{MODEL}"]\n[nodes.sim]\ntime_scale = 20.0\nload_time_s = 0.5\n')
    if events:
        out += (f'[nodes.kv_events]\nendpoint = "tcp://127.0.0.1:{free_port()}"\n'
                f'replay_endpoint = "tcp://127.0.0.1:{free_port()}"\n')
    return out


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    extra = (_node("h100-p", "nvidia_h100", True) + _node("mi300x-p", "amd_mi300x", True)
             + _node("a100-p", "nvidia_a100", False)
             + '[policies.cache-fleet]\nstrategy = "latency"\naccelerator_chain = ["H100", "MI300X", "A100"]\n')
    s = launch_stack(own_nats, tmp_path_factory.mktemp("prefix"), fleet=[("gaudi2-x", "intel_gaudi2", ["other/model"])],
                     extra=extra, routers=2, poll_s=0.5)
    try:
        wait_ready(s.gateway_url, MODEL, want_nodes=3)
        yield s
    finally:
        s.stop()


def _chat(s: Stack, messages: list[dict[str, str]], headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    r = httpx.post(s.gateway_url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": 4, **{"policy": "cache-fleet", **kw}})
    assert r.status_code == 200, r.text
    return r.json()


def test_nodes_show_their_cache_and_the_bridge(stack: Stack) -> None:
    deadline = time.monotonic() + 20
    while True:
        rows = {n["node_id"]: n for n in httpx.get(stack.gateway_url + "/v1/nodes", timeout=5).json()["nodes"]}
        if rows["h100-p"].get("cache_fidelity") == "precise" and rows["mi300x-p"].get("cache_fidelity") == "precise":
            break
        assert time.monotonic() < deadline, rows
    assert rows["a100-p"]["cache_fidelity"] == "reported" and "kv_events" not in rows["a100-p"]
    # each node's own engine geometry (vLLM's 16-token blocks on the H100, the Gaudi plugin's 128)
    assert rows["h100-p"]["kv_block_size"] == 16 and rows["gaudi2-x"]["kv_block_size"] == 128
    assert rows["h100-p"]["kv_blocks"] > 0 and rows["h100-p"]["kv_events"] == "live"


def test_follow_up_turns_stay_where_their_prefix_is(stack: Stack) -> None:
    rng = random.Random(3)
    convs = [[{"role": "system", "content": f"conversation {i}: " + " ".join(rng.choice(WORDS) for _ in range(600))}]
             for i in range(6)]
    first: dict[int, str] = {}
    same = reported = estimated = follow_ups = 0
    for turn in range(3):
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(8))})
            body = _chat(stack, conv)
            zml = body["zml"]
            conv.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            assert zml["cached_tokens"] == body["usage"]["prompt_tokens_details"]["cached_tokens"]
            if turn == 0:
                first[i] = zml["node_id"]
                continue
            follow_ups += 1
            same += zml["node_id"] == first[i]
            reported += zml["cached_tokens"] > 0
            estimated += zml["cached_tokens_estimated"] > 0
    assert same >= follow_ups - 1, (same, follow_ups)
    assert reported >= follow_ups - 1 and estimated >= follow_ups - 1, (reported, estimated, follow_ups)
    text = "".join(httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text
                   for name, p in stack.metrics_ports.items() if name.startswith("router"))
    assert 'zml_prefix_cache_tokens_total{kind="reported"' in text or 'kind="reported"' in text
    assert "zml_prefix_cache_index_entries" in text


async def _idle_as_the_routers_see_it(stack: Stack, nc: Any, node_id: str, since: float) -> None:
    """Until every router sees nothing in flight on ``node_id``, in a node state written after
    ``since`` (wall clock).

    A session yields its node when the node is over its load bound (zmlcore.policy.session),
    and on this fleet of three one or two requests in flight on it are over it. The test's own
    last request can still look in flight for a while after its reply: a health poll that
    caught it running reaches the routers later (up to a poll, 0.5 s here), and the peer
    router's in-flight delta lags a little (on a loaded box 4 of 80 sessions moved, each a
    "spilled" in the routers' zml_prefix_cache_sessions_total, the deciding router seeing 1 or 2
    in flight on the idle node). Once a router holds a state written after the reply, no poll
    that caught the request can follow it (a node is polled one poll at a time, its states
    arrive in order), and a peer's count of it only falls from then on (its +1, if sent at all,
    left before the reply). Only the bound node matters: load elsewhere raises the bound (more
    total load, same share)."""
    deadline = time.monotonic() + 20
    while True:
        seen = {}
        for router in (name for name in stack.procs if name.startswith("router")):
            asked = time.time()
            view = json.loads((await nc.request(subjects.router_state(router), b"", timeout=5)).data)["nodes"][node_id]
            seen[router] = view
            # written at asked - age or later (age is rounded to the ms)
            if view["effective_outstanding"] or asked - view["state_age_s"] - 0.001 <= since:
                break
        else:
            return
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.02)


async def test_a_session_keeps_short_prompts_on_one_node(stack: Stack) -> None:
    # round-robin spreads requests over every node, unless they belong to a session
    served = {_chat(stack, [{"role": "user", "content": f"hello {i}"}], policy="round_robin")["zml"]["node_id"]
              for i in range(6)}
    assert len(served) >= 2
    nc = await nats.connect(stack.nats_url)
    try:
        async def session(kind: str, headers: dict[str, str] | None, **kw: Any) -> set[str]:
            served: set[str] = set()
            since = 0.0
            for i in range(6):
                if served:  # on a fleet idle as the routers see it: the bound node has room
                    await _idle_as_the_routers_see_it(stack, nc, next(iter(served)), since)
                served.add(_chat(stack, [{"role": "user", "content": f"{kind} {i}"}], headers,
                                 policy="round_robin", **kw)["zml"]["node_id"])
                since = time.time()
            return served

        for n in range(3):
            served = await session("hi", {"x-session-id": f"s-{n}"})
            assert len(served) == 1, served
        # the OpenAI user field is a session too
        served = await session("yo", None, user="u-1")
        assert len(served) == 1, served
    finally:
        await nc.close()
