"""Simulated nodes speak the engines' disaggregation protocols over real HTTP: vLLM's
kv_transfer_params (prefill with do_remote_decode and max_tokens 1, held blocks, a decode that
pulls them at the link's speed and counts them cached, refusals of unknown or expired params)
and SGLang's bootstrap host/port/room (both legs at once)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from zml_sim.server import SimNode

M = "llama-3-8b"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 364  # ~4,000 tokens


@pytest.fixture
async def pair() -> AsyncIterator[tuple[SimNode, SimNode]]:
    # prefill 4 s of model time (0.4 s real): a decode leg that recomputed the prompt could not
    # hide in a busy box's HTTP overhead
    p = SimNode("p", "nvidia_h100", [M], time_scale=10.0, load_time_s=0.0, prefill_tps=1000.0, kv_gbps=100.0)
    d = SimNode("d", "amd_mi300x", [M], time_scale=10.0, load_time_s=0.0, prefill_tps=1000.0, kv_gbps=100.0)
    await p.start()
    await d.start()
    yield p, d
    await p.stop()
    await d.stop()


async def prefill_leg(c: httpx.AsyncClient, p: SimNode) -> dict[str, Any]:
    r = await c.post(p.url + "/v1/completions", json={
        "model": M, "prompt": PROMPT, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    assert r.status_code == 200, r.text
    return r.json()


async def decode_leg(c: httpx.AsyncClient, d: SimNode, params: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    """(status, usage or error, seconds to the first token) of a streamed decode leg."""
    t0 = time.monotonic()
    first = None
    usage: dict[str, Any] = {}
    async with c.stream("POST", d.url + "/v1/completions", json={
            "model": M, "prompt": PROMPT, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params}) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()) and r.json(), 0.0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.monotonic() - t0
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return 200, usage, first or 0.0


async def test_vllm_prefill_holds_blocks_and_decode_pulls_them(pair: tuple[SimNode, SimNode]) -> None:
    p, d = pair
    async with httpx.AsyncClient(timeout=30) as c:
        t0 = time.monotonic()
        reply = await prefill_leg(c, p)
        prefill_s = time.monotonic() - t0
        kv = reply["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "sim-p" and kv["remote_port"] == p.port and kv["remote_block_ids"]
        assert reply["usage"]["completion_tokens"] == 1 and p.handoff.holding == 1
        status, usage, ttft = await decode_leg(c, d, kv)
        assert status == 200
        prompt = usage["prompt_tokens"]
        # the decode leg did not recompute the prompt: the pulled blocks count as cached
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * prompt
        assert ttft < prefill_s / 2, (ttft, prefill_s)
        assert p.handoff.holding == 0 and d.engine.stats[M].cached_tokens >= 0.95 * prompt
        # the pulled blocks are in the decode node's prefix cache now (stored as its KV events say)
        from zml_sim.prefixcache import token_ids
        assert d.engine.cached_prefix(M, token_ids(PROMPT)) >= 0.95 * prompt
        # pulled once: the same params again are refused, as vLLM refuses unknown blocks
        status, err, _ = await decode_leg(c, d, kv)
        assert status == 400 and "unknown or expired" in err["error"]["message"]


async def test_vllm_refuses_expired_and_foreign_params(pair: tuple[SimNode, SimNode]) -> None:
    p, d = pair
    async with httpx.AsyncClient(timeout=30) as c:
        p.handoff.hold_s = 0.0  # vLLM frees held blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT
        kv = (await prefill_leg(c, p))["kv_transfer_params"]
        status, err, _ = await decode_leg(c, d, kv)
        assert status == 400 and "unknown or expired" in err["error"]["message"]
        assert p.handoff.expired_total == 1
        p.handoff.hold_s = 480.0
        kv = (await prefill_leg(c, p))["kv_transfer_params"]
        status, err, _ = await decode_leg(c, d, {**kv, "remote_engine_id": "someone-else"})
        assert status == 400 and "remote_engine_id" in err["error"]["message"]
        status, err, _ = await decode_leg(c, d, {**kv, "remote_port": None})
        assert status == 400


async def test_the_transfer_takes_the_links_time() -> None:
    p = SimNode("p", "nvidia_h100", [M], time_scale=10.0, load_time_s=0.0, kv_gbps=100.0)
    slow = SimNode("d", "amd_mi300x", [M], time_scale=10.0, load_time_s=0.0, kv_gbps=1.0)
    await p.start()
    await slow.start()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            kv = (await prefill_leg(c, p))["kv_transfer_params"]
            status, usage, ttft = await decode_leg(c, slow, kv)
            # ~4,000 tokens x 128 KiB at 1 Gbit/s: ~4.2 s of model time, 0.42 s at time_scale 10
            moved = usage["prompt_tokens_details"]["cached_tokens"]
            assert status == 200 and ttft >= 0.9 * moved * 131072 / 1.25e8 / 10
    finally:
        await p.stop()
        await slow.stop()


async def test_sglang_bootstrap_room_both_legs_at_once() -> None:
    p = SimNode("p", "nvidia_h100", [M], engine="sglang", time_scale=10.0, load_time_s=0.0, prefill_tps=4000.0)
    d = SimNode("d", "amd_mi300x", [M], engine="sglang", time_scale=10.0, load_time_s=0.0, prefill_tps=4000.0)
    await p.start()
    await d.start()
    try:
        await asyncio.gather(p.engine.wait_loaded(M), d.engine.wait_loaded(M))
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.port, "bootstrap_room": 123456789}
        body = {"model": M, "prompt": PROMPT, "max_tokens": 8, **boot}
        async with httpx.AsyncClient(timeout=30) as c:
            pr, dr = await asyncio.gather(c.post(p.url + "/v1/completions", json=body),
                                          c.post(d.url + "/v1/completions", json=body))
        assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text)
        usage = dr.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]
        assert p.handoff.pulled_total == 1 and p.handoff.holding == 0
    finally:
        await p.stop()
        await d.stop()


def test_doctests() -> None:
    import doctest

    from zml_sim import kvhandoff
    assert doctest.testmod(kvhandoff).failed == 0
