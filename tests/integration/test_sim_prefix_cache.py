"""A simulated node's prefix cache over real HTTP and ZMQ: follow-up turns report cached tokens
(vLLM's usage details, llama-server's timings) and run faster, /metrics carries vLLM's prefix-cache
counters and cache_config_info, and the KV events arrive on a ZMQ SUB socket in vLLM's format,
with the replay socket, evictions and a crash's fresh numbering."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from zmlcore.config import KVEventsConfig
from zmlcore.fleet.kvevents.wire import Cleared, Removed, Stored, decode_batch, seq_bytes, split_pub, split_replay
from zmlcore.runtime.launch import free_port
from zml_sim.prefixcache import token_ids
from zml_sim.server import SimNode

M = "llama-3-8b"
SYSTEM = "You are a careful assistant who answers in full sentences. " * 40  # ~600 tokens


def turn(history: list[dict[str, str]], user: str) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": user}]


async def chat(c: httpx.AsyncClient, url: str, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    r = await c.post(url + "/v1/chat/completions", json={"model": M, "messages": messages, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def kv_config() -> KVEventsConfig:
    return KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")


@pytest.fixture
async def vllm_node() -> AsyncIterator[SimNode]:
    n = SimNode("h100-1", "nvidia_h100", [M], time_scale=20.0, load_time_s=0.0, seed=1, kv_events=kv_config())
    await n.start()
    yield n
    await n.stop()


async def subscriber(endpoint: str) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    await asyncio.sleep(0.2)  # PUB/SUB: a subscription takes a moment to reach the publisher
    return ctx, sub


async def test_follow_up_turns_hit_the_cache_and_run_faster(vllm_node: SimNode) -> None:
    url = vllm_node.url
    async with httpx.AsyncClient(timeout=30) as c:
        first = await chat(c, url, turn([{"role": "system", "content": SYSTEM}], "What is a block?"))
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"},
                   {"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
        second = await chat(c, url, turn(history, "And a prefix?"))
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        bs = vllm_node.engine.profile.kv_block_size
        assert cached > 0 and cached % bs == 0
        assert cached >= (first["usage"]["prompt_tokens"] // bs - 1) * bs  # the whole first prompt, block-wise
        # streamed: the usage chunk carries the same details
        async with c.stream("POST", url + "/v1/chat/completions", json={
                "model": M, "messages": turn(history, "And a prefix?"), "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                      if line.startswith("data: {")]
        usage = [ch["usage"] for ch in chunks if ch.get("usage")]
        assert usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] >= cached
        metrics = (await c.get(url + "/metrics")).text
    stats = vllm_node.engine.stats[M]
    assert stats.prefix_hits >= 2 * cached and stats.prefix_queries > stats.prefix_hits
    assert f'vllm:prefix_cache_hits_total{{model_name="{M}",engine="0"}} {float(stats.prefix_hits)}' in metrics
    assert f'vllm:prefix_cache_queries_total{{model_name="{M}",engine="0"}} {float(stats.prefix_queries)}' in metrics
    assert f'block_size="{bs}"' in metrics
    blocks = vllm_node.engine.cache_capacity_blocks
    assert f'num_gpu_blocks="{blocks}"' in metrics and blocks == vllm_node.engine.kv_capacity_tokens // bs


async def test_cached_tokens_skip_prefill_time() -> None:
    n = SimNode("a100-1", "nvidia_a100", [M], time_scale=1.0, load_time_s=0.0, prefill_tps=20_000.0)
    await n.start()
    try:
        text = "z" * 4 * 4000  # 4,000 tokens: 200 ms of prefill at 20,000 tokens/s
        cold = n.engine.submit(M, 4000, 1, tokens=token_ids(text))
        await cold.text()
        warm = n.engine.submit(M, 4000, 1, tokens=token_ids(text))
        await warm.text()
        bs = n.engine.profile.kv_block_size  # whole blocks, never the last token (computed for its logits)
        assert cold.cached_tokens == 0 and warm.cached_tokens == (4000 - 1) // bs * bs
        assert cold.first_token_at is not None and warm.first_token_at is not None
        cold_ttft, warm_ttft = cold.first_token_at - cold.arrival, warm.first_token_at - warm.arrival
        assert cold_ttft >= 0.19 and warm_ttft < cold_ttft / 4
    finally:
        await n.stop()


async def test_kv_events_in_vllms_format_with_replay(vllm_node: SimNode) -> None:
    kv = vllm_node.kv_publisher
    assert kv is not None and kv.replay_endpoint is not None
    ctx, sub = await subscriber(kv.endpoint)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            await chat(c, vllm_node.url, [{"role": "user", "content": SYSTEM}])
            await chat(c, vllm_node.url, [{"role": "user", "content": SYSTEM + " and more text here " * 20}])
        got = []
        for _ in range(2):
            seq, payload = split_pub(await asyncio.wait_for(sub.recv_multipart(), 5))
            got.append((seq, decode_batch(payload)))
        assert [s for s, _ in got] == [0, 1]
        first, second = got[0][1].events[0], got[1][1].events[0]
        assert isinstance(first, Stored) and isinstance(second, Stored)
        bs = vllm_node.engine.profile.kv_block_size
        assert first.parent is None and first.block_size == bs and len(first.token_ids) == bs * len(first.hashes)
        assert second.parent == first.hashes[-1]  # the follow-up extends the cached chain
        # replay: a DEALER asks from 0 and gets both, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(kv.replay_endpoint)
        await dealer.send_multipart([b"", seq_bytes(0)])
        replayed = []
        while True:
            seq, payload = split_replay(await asyncio.wait_for(dealer.recv_multipart(), 5))
            if seq < 0:
                break
            replayed.append((seq, decode_batch(payload).events))
        assert replayed == [(s, b.events) for s, b in got]
        dealer.close()
    finally:
        sub.close()
        ctx.term()


async def test_evictions_and_a_crash_restart_the_numbering() -> None:
    n = SimNode("mi300x-1", "amd_mi300x", [M], time_scale=20.0, load_time_s=0.0, kv_cache_blocks=40,
                kv_events=kv_config())
    await n.start()
    kv = n.kv_publisher
    assert kv is not None
    ctx, sub = await subscriber(kv.endpoint)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            for i in range(3):  # 3 prompts of ~25 blocks of 16 into a 40-block cache
                await chat(c, n.url, [{"role": "user", "content": f"{i} " + "w" * 1600}])
        events = []
        while len([e for e in events if isinstance(e, Removed)]) < 2:
            _, payload = split_pub(await asyncio.wait_for(sub.recv_multipart(), 5))
            events.extend(decode_batch(payload).events)
        assert n.engine.prefix_cache is not None and n.engine.prefix_cache.blocks <= 40
        await n.crash(for_s=0.05)
        await asyncio.sleep(0.5)  # back, with new sockets
        sub.close()
        _, sub = await subscriber(kv.endpoint)
        await n.wait_listening()
        async with httpx.AsyncClient(timeout=30) as c:
            await chat(c, n.url, [{"role": "user", "content": "after the crash " * 10}])
        seq, payload = split_pub(await asyncio.wait_for(sub.recv_multipart(), 5))
        assert seq == 0  # a new engine process numbers from 0: subscribers see the restart
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.post(n.url + "/reset_prefix_cache")).status_code == 200
        _, payload = split_pub(await asyncio.wait_for(sub.recv_multipart(), 5))
        assert decode_batch(payload).events == [Cleared()]
    finally:
        sub.close()
        ctx.term()
        await n.stop()


async def test_llamacpp_face_reports_timings_cache_n() -> None:
    n = SimNode("cpu-1", "cpu", [M], engine="llamacpp", time_scale=50.0, load_time_s=0.0)
    await n.start()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
            one = await chat(c, n.url, msgs)
            two = await chat(c, n.url, [*msgs, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go"}])
            metrics = (await c.get(n.url + "/metrics")).text
        assert one["timings"]["cache_n"] == 0 and one["timings"]["prompt_n"] == one["usage"]["prompt_tokens"]
        cache_n = two["timings"]["cache_n"]
        assert cache_n > 0 and two["usage"]["prompt_tokens_details"]["cached_tokens"] == cache_n
        assert two["timings"]["prompt_n"] == two["usage"]["prompt_tokens"] - cache_n
        assert f"llamacpp:prompt_tokens_cached_total {float(cache_n)}" in metrics
    finally:
        await n.stop()
