"""A simulated node continues an answer the way the engine it imitates does (assistant prefill),
so the router's continuation of a failed stream is tested end to end without a real vLLM: the
text goes on where the prefix ends, and an engine asked the wrong way answers as it would."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from zml_sim.engine import filler_text, generated_tokens
from zml_sim.server import SimNode

M = "llama-3-8b"
USER = [{"role": "user", "content": "x" * 40}]


@pytest.fixture(params=["vllm", "sglang", "tgi", "llamacpp", "openai"])
async def node(request: pytest.FixtureRequest) -> AsyncIterator[SimNode]:
    n = SimNode("a-1", "nvidia_h100", [M], engine=request.param, time_scale=50.0, load_time_s=0.0, seed=1)
    await n.start()
    await n.engine.wait_loaded(M)
    yield n
    await n.stop()


async def stream(url: str, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30) as c:
        async with c.stream("POST", url + path, json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                return [json.loads(await r.aread())], r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    return events, 200


def content(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in events:
        for ch in e.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")
            if piece:
                out.append(piece)
    return out


def continuation_flags(engine: str) -> dict[str, Any]:
    """What the router sends each engine to continue a final assistant message."""
    if engine == "vllm":
        return {"continue_final_message": True, "add_generation_prompt": False}
    if engine in ("sglang", "tgi"):
        return {"continue_final_message": True}
    return {}


async def test_a_stream_has_one_event_per_token(node: SimNode) -> None:
    events, status = await stream(node.url, "/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 9})
    assert status == 200
    pieces = content(events)
    assert len(pieces) == 9 and "".join(pieces) == filler_text("a-1", 0, 9)
    assert events[-1]["usage"]["completion_tokens"] == 9


async def test_a_final_assistant_message_is_continued_as_the_engine_does(node: SimNode) -> None:
    whole = filler_text("a-1", 0, 12)
    k = 5
    prefix = filler_text("a-1", 0, k)  # what a first node sent before it failed
    body = {"model": M, "messages": [*USER, {"role": "assistant", "content": prefix}], "max_tokens": 12 - k,
            **continuation_flags(node.engine_kind)}
    events, status = await stream(node.url, "/v1/chat/completions", body)
    assert status == 200, events
    rest = "".join(content(events))
    usage = events[-1]["usage"]
    if node.engine_kind == "openai":  # no prefill: a new message, from the node tag again
        assert rest == filler_text("a-1", 0, 12 - k)
        return
    assert prefix + rest == whole  # no token repeated, none lost
    assert usage["completion_tokens"] == 12 - k
    # The prefix counts as prompt: its tokens as generated, the user's text as the sim counts it.
    assert usage["prompt_tokens"] == 10 + generated_tokens(prefix)


async def test_vllm_wants_add_generation_prompt_off_and_others_need_the_flag(node: SimNode) -> None:
    prefix = filler_text("a-1", 0, 4)
    messages = [*USER, {"role": "assistant", "content": prefix}]
    events, status = await stream(node.url, "/v1/chat/completions",
                                  {"model": M, "messages": messages, "max_tokens": 3, "continue_final_message": True})
    if node.engine_kind == "vllm":  # vLLM's own 400
        assert status == 400 and "add_generation_prompt" in json.dumps(events)
    else:
        assert status == 200
    events, status = await stream(node.url, "/v1/chat/completions", {"model": M, "messages": messages, "max_tokens": 3})
    assert status == 200
    rest = "".join(content(events))
    # Without the flag only llama.cpp (prefill on by default) continues; the others start anew.
    assert rest == (filler_text("a-1", 4, 7) if node.engine_kind == "llamacpp" else filler_text("a-1", 0, 3))


async def test_a_completion_prompt_ending_with_the_text_so_far_goes_on(node: SimNode) -> None:
    prompt = "Once upon a time "
    prefix = filler_text("a-1", 0, 6)
    events, status = await stream(node.url, "/v1/completions", {"model": M, "prompt": prompt + prefix, "max_tokens": 4})
    assert status == 200
    assert prefix + "".join(content(events)) == filler_text("a-1", 0, 10)
    assert events[-1]["usage"]["prompt_tokens"] == 5 + 6  # 17 characters, then 6 generated tokens


async def test_stall_mid_stream_sends_nothing_after_the_first_token() -> None:
    n = SimNode("a-1", "nvidia_h100", [M], time_scale=50.0, load_time_s=0.0, seed=1)
    await n.start()
    try:
        await n.engine.wait_loaded(M)
        n.engine.faults = n.engine.faults.updated({"stall_mid_stream": 1.0})
        got: list[str] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=1.0)) as c:
            async with c.stream("POST", n.url + "/v1/chat/completions",
                                json={"model": M, "messages": USER, "max_tokens": 20, "stream": True}) as r:
                with pytest.raises(httpx.ReadTimeout):  # open, and silent
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            got.append(line)
        assert 1 <= len(got) <= 2  # the role event and the first token, nothing more
        assert n.engine.running == 0  # its slot is free again
    finally:
        await n.stop()
