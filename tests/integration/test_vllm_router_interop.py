"""Interop: vLLM's own router in P/D mode (PyPI ``vllm-router``, ``--vllm-pd-disaggregation``)
in front of ZML's simulated vLLM nodes completes every request, and the decode node does not
recompute the prompt: it pulls the prefill node's blocks (its own counters count them cached,
as vLLM counts tokens loaded through a KV connector).

vllm-router 0.1.17 rewrites a non-streamed reply's ``cached_tokens`` to the *prefill* node's
own cache hits (its ``pd_cached_tokens``: the decode's count is transfer accounting), so the
decode leg's work is read from the decode node itself, not from the reply."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import subprocess
from collections.abc import AsyncIterator

import httpx
import pytest

from zmlcore.runtime.launch import free_port
from zml_sim.server import SimNode

M = "llama-3-8b"
# This venv's, also when pytest runs as .venv/bin/python without the venv on PATH.
ROUTER = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")


@pytest.fixture
async def pd_router() -> AsyncIterator[tuple[str, SimNode, SimNode]]:
    assert ROUTER is not None, "vllm-router is a test dependency (pip install -e '.[test]')"
    p = SimNode("p", "nvidia_h100", [M], time_scale=20.0, load_time_s=0.0, kv_gbps=100.0)
    d = SimNode("d", "amd_mi300x", [M], time_scale=20.0, load_time_s=0.0, kv_gbps=100.0)
    await p.start()
    await d.start()
    port = free_port()
    proc = subprocess.Popen(
        [ROUTER, "--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            for _ in range(150):
                try:
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
            else:
                pytest.fail("vllm-router did not become ready")
        yield url, p, d
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        await p.stop()
        await d.stop()


async def test_vllm_router_pd_mode_over_zml_sims(pd_router: tuple[str, SimNode, SimNode]) -> None:
    url, p, d = pd_router
    prompts = [f"Request {i}: " + "summarise the following report carefully. " * (60 + 20 * i) for i in range(12)]

    async def one(i: int, text: str) -> tuple[int, int]:
        body: dict[str, object] = {"model": M, "max_tokens": 6}
        stream = i % 2 == 1
        if i % 3 == 0:
            body["prompt"] = text
            path = "/v1/completions"
        else:
            body["messages"] = [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url + path, json=body)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            usage = next(ch["usage"] for ch in reversed(chunks) if ch.get("usage"))
        else:
            usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["completion_tokens"]

    results = await asyncio.gather(*(one(i, t) for i, t in enumerate(prompts)))
    assert len(results) == len(prompts) and all(out == 6 for _, out in results)  # 100% complete
    prompt_total = sum(pt for pt, _ in results)
    # every request was prefilled on p and decoded on d from p's blocks
    assert p.handoff.held_total == len(prompts) and p.handoff.pulled_total == len(prompts)
    stats = d.engine.stats[M]
    assert stats.cached_tokens >= 0.95 * prompt_total, (stats.cached_tokens, prompt_total)
    assert p.engine.stats[M].generation_tokens == len(prompts)  # max_tokens 1 on the prefill node
