"""Issue 20 item 1: a node that fails after the first token (drops the connection, stalls) has
its answer continued on another node of the policy's chain, through each engine's own way of
continuing an assistant message, and spliced into the one stream the client reads: the text
reads as if one node wrote it (the sims' token ``i`` is the same word everywhere, so a token
lost or repeated shows), one ``finish_reason``, usage that adds up, ``zml.continued_from``.
Where an answer must not or cannot be continued, the stream ends with the clean error it had.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest

from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects
from zmlcore.messages import StreamResume
from zmlcore.reply import resume as resumes
from zml_sim.engine import token_text

FLEET = [
    ("h100-a", "nvidia_h100", [MODEL]),  # the node that fails (vLLM)
    ("h100-b", "nvidia_h100", [MODEL], 'family = "H100B"\n'),  # vLLM
    ("mi300x-a", "amd_mi300x", [MODEL], 'backend = "llamacpp"\n'),
    ("a100-a", "nvidia_a100", [MODEL], 'backend = "sglang"\n'),
    ("gaudi-a", "intel_gaudi2", [MODEL], 'backend = "tgi"\n'),
    ("inf2-a", "aws_inferentia2", [MODEL], 'backend = "openai"\n'),
]
TARGETS = {"vllm": "H100B", "llamacpp": "MI300X", "sglang": "A100", "tgi": "Gaudi2", "openai": "Inferentia2"}
NODE_OF = {"H100B": "h100-b", "MI300X": "mi300x-a", "A100": "a100-a", "Gaudi2": "gaudi-a", "Inferentia2": "inf2-a"}


def _policy(name: str, second: str, more: str = "") -> str:
    # Latency priority walks the chain in order: h100-a first, then the engine under test.
    return (f'[policy.{name}]\naccelerator_chain = ["H100", "{second}"]\ncost_priority = "latency"\n'
            f"latency_target_ms = 60000\n{more}")


POLICIES = "".join(_policy(f"to-{engine}", fam) for engine, fam in TARGETS.items()) + \
    _policy("no-continue", "H100B", "continue_on_failure = false\n")


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # No cooldown: h100-a stays first in every chain however often it fails.
    s = launch_stack(own_nats, tmp_path_factory.mktemp("cont"), fleet=FLEET, routers=1, poll_s=0.3, extra=POLICIES,
                     router="cooldown_s = 0\ninter_token_timeout_s = 1.0\n")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture()
def failing(stack: Stack) -> Iterator[Stack]:
    stack.faults("h100-a", drop_mid_stream=1.0, fail_after_tokens=5)
    try:
        yield stack
    finally:
        stack.faults("h100-a", drop_mid_stream=0.0, stall_mid_stream=0.0, fail_after_tokens=1)


def continued(value: str) -> list[tuple[str, int, str]]:
    """``zml.continued_from`` (``node@tokens:failure,...``) read back."""
    out = []
    for entry in value.split(","):
        node, rest = entry.split("@")
        tokens, failure = rest.split(":")
        out.append((node, int(tokens), failure))
    return out


def words(node: str, n: int) -> str:
    return "".join(token_text(node, i) for i in range(n))


async def sse(stack: Stack, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[httpx.Headers, list[Any]]:
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        async with c.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            return r.headers, events


async def raw_stream(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[tuple[str, int, Any]]:
    """A stream asked on raw NATS (zml.infer), to its ``end``: (kind, seq, JSON) of each message."""
    nc = await nats.connect(url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.INFER, json.dumps({"model": MODEL, "stream": True, **body}).encode(), reply=inbox,
                         headers=headers)
        got: list[tuple[str, int, Any]] = []
        while not got or got[-1][0] != "end":
            m = await sub.next_msg(timeout=20)
            got.append((m.headers[subjects.H_STREAM], int(m.headers[subjects.H_SEQ]), json.loads(m.data)))
        return got
    finally:
        await nc.close()


def read(events: list[Any]) -> tuple[str, list[str], dict[str, Any] | None, dict[str, Any] | None, set[str]]:
    """(text, finish reasons, usage, zml, chunk ids) of a stream's events."""
    text, finishes, usage, zml, ids = [], [], None, None, set()
    for e in events:
        if e == "[DONE]":
            continue
        assert "error" not in e, e
        ids.add(e["id"])
        for ch in e.get("choices") or []:
            piece = ch["delta"].get("content") if "delta" in ch else ch.get("text")
            text.append(piece or "")
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
        usage = e.get("usage") or usage
        zml = e.get("zml") or zml
    return "".join(text), finishes, usage, zml, ids


@pytest.mark.parametrize("engine", ["vllm", "llamacpp", "sglang", "tgi"])
async def test_a_stream_cut_mid_way_is_continued_on_another_engine(failing: Stack, engine: str) -> None:
    headers, events = await sse(failing, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 24,
                                          "policy": f"to-{engine}", "stream_options": {"include_usage": True}})
    assert headers["x-zml-node-id"] == "h100-a"  # the stream began there
    assert events[-1] == "[DONE]"
    text, finishes, usage, zml, ids = read(events)
    assert text == words("h100-a", 24)  # one answer: no token lost, none repeated
    assert finishes == ["length"] and len(ids) == 1
    assert usage is not None and usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == 2 and usage["total_tokens"] == 26  # "hello": the first attempt's prompt
    assert zml is not None and zml["attempts"] == 2 and zml["node_id"] == NODE_OF[TARGETS[engine]]
    ((node, tokens, failure),) = continued(zml["continued_from"])
    assert node == "h100-a" and failure == "network" and tokens >= 5
    assert failing.sim_state(NODE_OF[TARGETS[engine]])["counters"][MODEL]["success"]["length"] >= 1


async def test_a_completion_is_continued_from_the_prompt_plus_the_text(failing: Stack) -> None:
    _, events = await sse(failing, {"prompt": "Once upon a time ", "max_tokens": 16, "policy": "to-vllm"},
                          path="/v1/completions")
    text, finishes, _, zml, _ = read(events)
    assert text == words("h100-a", 16) and finishes == ["length"]
    assert zml is not None and continued(zml["continued_from"])[0][0] == "h100-a"


async def test_a_stalled_node_is_left_after_the_inter_token_deadline(stack: Stack) -> None:
    stack.faults("h100-a", stall_mid_stream=1.0, fail_after_tokens=3)
    try:
        _, events = await sse(stack, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                                      "policy": "to-llamacpp"})
    finally:
        stack.faults("h100-a", stall_mid_stream=0.0, fail_after_tokens=1)
    text, finishes, _, zml, _ = read(events)
    assert text == words("h100-a", 12) and finishes == ["length"]
    assert zml is not None and continued(zml["continued_from"])[0][2] == "slow"


async def test_raw_nats_gets_one_numbered_stream_and_the_end_says_what_happened(failing: Stack) -> None:
    got = await raw_stream(failing.nats_url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
                                              "policy": "to-vllm"})
    seqs, text = [seq for _, seq, _ in got], []
    for kind, _, data in got:
        if kind == "chunk":
            for ch in data["choices"]:
                text.append(ch["delta"].get("content") or "")
        else:
            assert kind in ("start", "end"), (kind, data)
    end = got[-1][2]["routing"]
    assert seqs == list(range(len(seqs)))  # one numbering across both nodes
    assert "".join(text) == words("h100-a", 10)
    assert end["node_id"] == "h100-b" and end["attempts"] == 2
    assert continued(end["continued_from"])[0][0] == "h100-a" and end["time_to_first_token"] > 0


@pytest.mark.parametrize(("extra", "why"), [
    ({"seed": 7}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"continue_on_failure": False}, "continue_on_failure"),
    ({"policy": "no-continue"}, "continue_on_failure"),
    ({"policy": "to-openai"}, "no other node could continue"),
])
async def test_where_an_answer_must_not_or_cannot_be_continued_the_stream_ends_with_the_error(
        failing: Stack, extra: dict[str, Any], why: str) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 24, "policy": "to-vllm", **extra}
    _, events = await sse(failing, body)
    assert events[-1] != "[DONE]"
    err = events[-1]["error"]
    assert err["code"] == "BACKEND_ERROR" and why in err["message"], err
    text = "".join((e["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e.get("choices"))
    assert words("h100-a", 24).startswith(text) and text  # what was sent, and nothing of another node


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 6,
                              "continue_on_failure": False, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "Once upon a time ", "max_tokens": 6, "seed": 3}),
])
async def test_a_node_cut_after_the_last_token_has_its_answer_ended_not_failed(
        stack: Stack, path: str, body: dict[str, Any]) -> None:
    """Every token ``max_tokens`` allowed went out and only the end was lost (the node dropped
    the connection before its finish chunk): the router ends the answer as the node would have
    (``finish_reason: "length"``), asking no other node, even where a continuation would be
    refused (a seed, continue_on_failure false). The usage chunk was lost with the node."""
    stack.faults("h100-a", drop_mid_stream=1.0, fail_after_tokens=6)
    asked = stack.decisions("h100-b")
    try:
        headers, events = await sse(stack, {**body, "policy": "to-vllm"}, path=path)
    finally:
        stack.faults("h100-a", drop_mid_stream=0.0, fail_after_tokens=1)
    assert headers["x-zml-node-id"] == "h100-a" and events[-1] == "[DONE]"
    text, finishes, usage, zml, ids = read(events)
    assert text == words("h100-a", 6) and finishes == ["length"] and len(ids) == 1
    assert usage is None
    assert zml is not None and zml["ended_by"] == "router" and zml["node_id"] == "h100-a", zml
    assert continued(zml["continued_from"]) == [("h100-a", 6, "network")]
    assert stack.sim_state("h100-a")["counters"][MODEL]["prompt_tokens"] > 0
    assert stack.decisions("h100-b") == asked  # nobody asked
    assert stack.decisions("h100-a") > 0  # (what asked h100-a is counted)


async def test_raw_nats_gets_the_end_of_an_answer_cut_after_its_last_token(stack: Stack) -> None:
    stack.faults("h100-a", drop_mid_stream=1.0, fail_after_tokens=4)
    try:
        got = await raw_stream(stack.nats_url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                                                "policy": "to-vllm"})
    finally:
        stack.faults("h100-a", drop_mid_stream=0.0, fail_after_tokens=1)
    seqs = [seq for _, seq, _ in got]
    chunks = [data for kind, _, data in got if kind == "chunk"]
    end = got[-1][2]["routing"]
    assert seqs == list(range(len(seqs)))
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    assert text == words("h100-a", 4) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["id"] == chunks[0]["id"] and chunks[-1]["object"] == "chat.completion.chunk"
    assert end["node_id"] == "h100-a" and continued(end["continued_from"]) == [("h100-a", 4, "network")]


async def test_a_resumed_stream_that_had_every_token_is_ended_by_the_new_router(stack: Stack) -> None:
    """Its router died after the last token, before the end (``Zml-Resume`` as the gateway and
    the SDK send it): the router that takes it over ends the answer and asks no node."""
    asked = stack.decisions("h100-a")
    had = StreamResume(text=words("h100-a", 4), tokens=4, seq=5, chunk_id="chatcmpl-x", created=1700000000,
                       node_id="h100-a", attempts=1)
    got = await raw_stream(stack.nats_url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                                            "policy": "to-vllm"},
                           {subjects.H_RESUME: resumes.encode(had), subjects.H_REQUEST_ID: "resumed-whole-1"})
    (kind, seq, last), (_, end_seq, end) = got
    assert (kind, seq, end_seq) == ("chunk", 6, 7), got  # numbered on from what the requester had
    assert last["id"] == "chatcmpl-x" and last["created"] == 1700000000
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    assert end["routing"]["node_id"] == "h100-a"
    assert continued(end["routing"]["continued_from"]) == [("h100-a", 4, "router")]
    assert stack.decisions("h100-a") == asked


# --- non-streamed requests (issue 20 item 4: the router streams from the node) ----------------

async def chat_once(stack: Stack, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        return await c.post("/v1/chat/completions", json={"model": MODEL, **body})


async def test_a_non_streamed_answer_cut_mid_way_is_continued_too(failing: Stack) -> None:
    r = await chat_once(failing, messages=[{"role": "user", "content": "hello"}], max_tokens=24, policy="to-tgi")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == words("h100-a", 24)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 24 and body["usage"]["prompt_tokens"] == 2
    zml = body["zml"]
    assert zml["node_id"] == "gaudi-a" and zml["attempts"] == 2
    ((node, tokens, failure),) = continued(zml["continued_from"])
    assert node == "h100-a" and failure == "network" and tokens >= 5
    assert r.headers["x-zml-continued-from"] == zml["continued_from"]


async def test_a_non_streamed_answer_that_must_not_be_continued_starts_again(failing: Stack) -> None:
    # Nothing reached the client: with a seed it is asked again, whole, of the next node.
    r = await chat_once(failing, messages=[{"role": "user", "content": "hello"}], max_tokens=12, seed=5,
                        policy="to-vllm")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == words("h100-b", 12)
    assert body["zml"]["attempts"] == 2 and body["zml"].get("continued_from") is None


def node_ttft(stack: Stack, node: str) -> tuple[float, float]:
    """(count, sum) of the node's own ``vllm:time_to_first_token_seconds`` histogram."""
    text = httpx.get(stack.sim_url(node) + "/metrics", timeout=5).text
    got = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"vllm:time_to_first_token_seconds_{k}") and f'"{MODEL}"' in line:
                got[k] += float(line.rsplit(" ", 1)[1])
    return got["count"], got["sum"]


async def test_a_non_streamed_request_has_its_first_tokens_time(stack: Stack) -> None:
    """Issue 20's target: a non-streamed reply's time_to_first_token is within 5 ms of the
    node's own vllm:time_to_first_token_seconds (measured: ~1 ms; it was the whole reply's,
    here 48 tokens of decoding, ~45 ms, later)."""
    diffs = []
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        for _ in range(14):
            n0, s0 = node_ttft(stack, "h100-b")
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 48,
                "accelerator_id": "h100-b"})
            assert r.status_code == 200, r.text
            n1, s1 = node_ttft(stack, "h100-b")
            ttft = r.json()["zml"]["time_to_first_token"]
            assert float(r.headers["x-zml-time-to-first-token"]) == pytest.approx(ttft, abs=1e-3)
            if n1 == n0 + 1:  # (else a health calibration also ran there meanwhile: not this one's alone)
                diffs.append(ttft - (s1 - s0))
            if len(diffs) == 7:
                break
    assert len(diffs) == 7, diffs
    diffs.sort()
    # The router's count starts when it takes the request, the node's when the request reaches
    # it: the router's is a little longer, never shorter.
    assert diffs[0] > -0.001 and diffs[len(diffs) // 2] < 0.005, diffs


async def test_a_non_streamed_answer_stalled_mid_way_is_continued(stack: Stack) -> None:
    """Headers and a few tokens, then nothing: a non-streamed request notices the stall after
    [router] inter_token_timeout_s (1 s here) and has its answer continued, instead of waiting
    out the whole reply's first-byte deadline (at least 5 s) and asking again from scratch."""
    stack.faults("h100-a", stall_mid_stream=1.0, fail_after_tokens=3)
    try:
        r = await chat_once(stack, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
                            policy="to-sglang")
    finally:
        stack.faults("h100-a", stall_mid_stream=0.0, fail_after_tokens=1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == words("h100-a", 12)
    ((node, tokens, failure),) = continued(body["zml"]["continued_from"])
    assert node == "h100-a" and failure == "slow" and tokens >= 3
    assert r.elapsed.total_seconds() < 4.0


async def test_a_node_that_refuses_stream_options_is_asked_as_the_caller_asked(stack: Stack) -> None:
    """An OpenAI-compatible server that does not know ``stream_options`` answers 400 to a
    non-streamed request asked as a stream: the router asks it again as the caller asked (the
    reply as the node made it) and asks it so from then on; a request the node refuses either
    way is still the caller's 400."""
    refusals = "refused a non-streamed request asked as a stream"
    stack.faults("inf2-a", refuse_stream_options=True)
    try:
        for _ in range(2):
            r = await chat_once(stack, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                accelerator_id="inf2-a")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == words("inf2-a", 8)
        assert stack.procs["router-1"].tail(400).count(refusals) == 1  # the second went as it came
        bad = await chat_once(stack, messages=[{"role": "user", "content": "hello"}], max_tokens=10**7,
                              accelerator_id="a100-a")
        assert bad.status_code == 400, bad.text
        assert stack.procs["router-1"].tail(400).count(refusals) == 1  # a bad request marks no node
    finally:
        stack.faults("inf2-a", refuse_stream_options=False)


async def test_an_engines_error_event_mid_stream_is_continued(stack: Stack) -> None:
    """vLLM sends ``data: {"error": ...}`` and ends the stream when it fails a request mid-way
    (here: its model unloaded under the request). Last in this module: h100-a loads again after."""
    stack.faults("h100-a", slowdown=30.0)  # a long stream, cut once it has begun
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20,
            "policy": "to-sglang"}
    events: list[Any] = []
    try:
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200 and r.headers["x-zml-node-id"] == "h100-a"
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                    if len(events) == 2:  # the role and the first token: the engine fails it now
                        u = await c.post(stack.sim_url("h100-a") + "/sim/unload", json={"model": MODEL})
                        assert u.status_code == 200, u.text
    finally:
        stack.faults("h100-a", slowdown=1.0)
        httpx.post(stack.sim_url("h100-a") + "/sim/load", json={"model": MODEL}, timeout=10)
    text, finishes, _, zml, _ = read(events)
    assert text == words("h100-a", 20) and finishes == ["length"]
    assert zml is not None and continued(zml["continued_from"])[0][::2] == ("h100-a", "server")
