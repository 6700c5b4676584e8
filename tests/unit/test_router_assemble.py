"""zml_router.answer.assemble: a non-streamed request's reply put back together from the node's
stream, field for field what the engine would have answered; across a continuation, one answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from zml_router.answer import assemble
from zml_router.answer.assemble import Assembler, EngineFailed, MalformedStream


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


BASE = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1700, "model": "m",
        "system_fingerprint": "fp"}


def ch(delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {**BASE, "choices": [choice], **extra}


USAGE = {**BASE, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_a_chat_stream_becomes_the_chat_completion() -> None:
    a = Assembler("chat")
    a.feed(sse(ch({"role": "assistant", "content": ""}), ch({"content": "The "}), ch({"content": "cat"}),
               ch(finish="stop"), USAGE))
    assert a.done
    got = json.loads(a.reply())
    assert got == {"id": "chatcmpl-9", "object": "chat.completion", "created": 1700, "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "The cat"},
                                "logprobs": None, "finish_reason": "stop"}],
                   "system_fingerprint": "fp", "usage": USAGE["usage"]}
    assert json.loads(a.reply(model="asked"))["model"] == "asked"


def test_llama_servers_timings_and_other_top_level_fields_are_kept() -> None:
    last = {**USAGE, "timings": {"cache_n": 4, "prompt_n": 1}}
    a = Assembler("chat")
    a.feed(sse(ch({"role": "assistant", "content": None}), ch({"content": "x"}), ch(finish="length"), last))
    got = json.loads(a.reply())
    assert got["timings"] == {"cache_n": 4, "prompt_n": 1} and got["usage"]["total_tokens"] == 8


def test_events_cut_anywhere_between_reads() -> None:
    body = sse(ch({"role": "assistant", "content": ""}), ch({"content": "a\u2028b"}), ch(finish="stop"), USAGE)
    for cut in (1, 7, 40, len(body) - 3):
        a = Assembler("chat")
        a.feed(body[:cut])
        a.feed(body[cut:])
        assert json.loads(a.reply())["choices"][0]["message"]["content"] == "a\u2028b", cut


def test_tool_calls_reasoning_and_several_choices() -> None:
    a = Assembler("chat")
    a.feed(sse(
        ch({"role": "assistant", "reasoning_content": "think "}),
        ch({"reasoning_content": "more"}),
        ch({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "get", "arguments": "{\"a\""}}]}),
        ch({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        ch({"role": "assistant", "content": "hi"}, index=1),
        ch(finish="tool_calls"), ch(finish="stop", index=1), USAGE))
    got = json.loads(a.reply())
    first, second = got["choices"]
    assert first["message"] == {"role": "assistant", "content": None, "reasoning_content": "think more",
                                "tool_calls": [{"id": "call_1", "type": "function",
                                                "function": {"name": "get", "arguments": "{\"a\": 1}"}}]}
    assert first["finish_reason"] == "tool_calls"
    assert second == {"index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                      "finish_reason": "stop"}
    assert a.sent().blocked  # not an answer to continue


def test_completion_text_and_logprobs_are_joined() -> None:
    def c(text: str, lp: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

    a = Assembler("completion")
    a.feed(sse(c("a", {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": None, "text_offset": [0]}),
               c("b", {"tokens": ["b"], "token_logprobs": [-0.2], "top_logprobs": None, "text_offset": [1]}, "length")))
    got = json.loads(a.reply())
    assert got["object"] == "text_completion"
    assert got["choices"][0] == {"index": 0, "text": "ab", "finish_reason": "length",
                                 "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                              "top_logprobs": None, "text_offset": [0, 1]}}


def test_a_continued_answer_is_one_reply_and_its_usage_adds_up() -> None:
    a = Assembler("chat")
    a.feed(sse(ch({"role": "assistant", "content": ""}), ch({"content": "The "}), ch({"content": "cat "}),
               done=False))  # the node died here
    sent = a.begin_continuation()
    assert (sent.text, sent.tokens, sent.chunk_id) == ("The cat ", 2, "chatcmpl-9")
    other = {"id": "chatcmpl-other", "created": 9, "model": "m", "object": "chat.completion.chunk"}
    a.feed(sse({**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               {**other, "choices": [{"index": 0, "delta": {"content": "sat"}}]},
               {**other, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
               {**other, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}))
    got = json.loads(a.reply())
    assert got["id"] == "chatcmpl-9" and got["created"] == 1700
    assert got["choices"][0]["message"] == {"role": "assistant", "content": "The cat sat"}
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_an_engines_error_event_and_a_broken_chunk() -> None:
    a = Assembler("chat")
    a.feed(sse(ch({"content": "x"}), {"error": {"message": "CUDA error", "code": 500}}))
    with pytest.raises(EngineFailed, match="CUDA error"):
        a.reply()
    b = Assembler("chat")
    b.feed(b"data: {not json}\n\n")
    with pytest.raises(MalformedStream):
        b.reply()


def test_the_node_is_asked_for_a_stream_with_its_usage() -> None:
    assert json.loads(assemble.as_stream(b'{"model":"m","messages":[]}')) == {
        "model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}}
    assert json.loads(assemble.as_stream(b'{"stream": false, "model": "m"}'))["stream"] is True
    assert assemble.as_stream(b"{}") == b'{"stream":true,"stream_options":{"include_usage":true}}'
    assert assemble.wanted(b'{"model":"m"}') and not assemble.wanted(b'{"model":"m","best_of":2}')


def test_a_model_may_keep_its_non_streamed_requests_whole() -> None:
    from types import SimpleNamespace

    from zmlcore.config import parse_config
    from zmlcore.messages import InferRequest
    from zml_router.node.relay import Relay

    cfg = parse_config({"models": {"short": {"stream_from_nodes": False}}})
    relay = Relay(cfg, "r", None, SimpleNamespace(move=None), None, None, None, None)  # type: ignore[arg-type]
    chat = InferRequest(model="m", messages=[])
    raw = b'{"model":"m","messages":[]}'
    assert relay.answer(chat, raw, "m").assembler is not None  # by default: streamed from the node
    assert relay.answer(chat, raw, "short").assembler is None  # the model's switch
    assert relay.answer(InferRequest(model="m", input="x"), raw, "m").assembler is None  # embeddings never
    assert relay.answer(chat, b'{"model":"m","best_of":2}', "m").assembler is None  # non-streaming-only


def _tokens(*pieces: Any, **extra: Any) -> list[dict[str, Any]]:
    return [ch({"content": p}, **extra) for p in pieces]


#: Bodies of the shapes engines send and of shapes that break a run of content chunks.
RUN_BODIES = {
    "plain": sse(ch({"role": "assistant", "content": ""}), *_tokens("The", " cat", " sat", ""), ch(finish="stop"),
                 USAGE),
    "escapes": sse(ch({"role": "assistant", "content": ""}),
                   *_tokens('say "hi"', "back\\slash\\", "\\", "line\nend", "a\u2028b", "é", '"content": "x"'),
                   ch(finish="stop"), USAGE),
    "compact, no role chunk": b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in (
        *_tokens("a", "b", "c"), ch(finish="length"), USAGE)) + b"data: [DONE]\n\n",
    "created changes mid-run": sse(*_tokens("a", "b"), *[{**c, "created": 1701} for c in _tokens("c", "d")],
                                   ch(finish="stop"), USAGE),
    "another field beside the content": sse(*_tokens("a", "b"), ch({"content": "c", "role": "user"}),
                                            *_tokens("d"), ch(finish="stop"), USAGE),
    "a null content mid-run": sse(*_tokens("a", "b", None, "c"), ch(finish="stop"), USAGE),
    "reasoning, then content": sse(ch({"role": "assistant", "reasoning_content": "hm"}), *_tokens("a", "b", "c"),
                                   ch(finish="stop"), USAGE),
    "logprobs": sse(*[{**c, "choices": [{**c["choices"][0], "logprobs": {"content": [{"token": t}]}}]}
                      for t, c in zip("abc", _tokens("a", "b", "c"))], ch(finish="stop"), USAGE),
    "the run at the end": sse(ch({"role": "assistant", "content": ""}), *_tokens("a", "b", "c")),
    "timings on the last chunk": sse(*_tokens("a", "b", "c"), ch(finish="stop"),
                                     {**USAGE, "timings": {"cache_n": 4}}),
}


@pytest.fixture
def _runs_of_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assemble, "_RUN_MIN_BYTES", 0)  # these bodies are short


@pytest.mark.usefixtures("_runs_of_any_size")
@pytest.mark.parametrize("name", list(RUN_BODIES))
def test_a_run_of_content_chunks_read_at_once_is_read_as_chunk_by_chunk(name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    body = RUN_BODIES[name]
    fast = Assembler("chat")
    fast.feed(body)
    got = (fast.reply(), fast.sent(), fast.counts())
    monkeypatch.setattr(Assembler, "_run", lambda self, body: None)
    slow = Assembler("chat")
    slow.feed(body)
    assert got == (slow.reply(), slow.sent(), slow.counts())


@pytest.mark.usefixtures("_runs_of_any_size")
def test_the_common_stream_is_read_without_a_struct_per_token() -> None:
    for name in ("plain", "escapes", "compact, no role chunk", "reasoning, then content"):
        run = Assembler("chat")._run(RUN_BODIES[name])
        assert run is not None and run[1], name
    for name in ("another field beside the content", "a null content mid-run", "logprobs", "the run at the end"):
        assert Assembler("chat")._run(RUN_BODIES[name]) is None, name
    assert Assembler("chat")._run(RUN_BODIES["plain"][:-20]) is None  # a partial body: chunk by chunk
    a = Assembler("chat")
    a.feed(RUN_BODIES["escapes"])
    assert json.loads(a.reply())["choices"][0]["message"]["content"] == \
        'say "hi"back\\slash\\\\line\nenda\u2028bé"content": "x"'
    assert a.counts() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


@pytest.mark.usefixtures("_runs_of_any_size")
def test_a_broken_chunk_inside_a_run_is_not_read_as_two_tokens() -> None:
    body = RUN_BODIES["plain"].replace(b'"content": " sat"', b'"content": " sat", " on"')
    assert body != RUN_BODIES["plain"]
    a = Assembler("chat")
    a.feed(body)
    with pytest.raises(MalformedStream):
        a.reply()


def test_a_short_body_is_read_chunk_by_chunk_a_long_one_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    short = RUN_BODIES["plain"]
    long = sse(ch({"role": "assistant", "content": ""}), *_tokens(*[f" w{i}" for i in range(60)]), ch(finish="stop"),
               USAGE)
    assert len(short) < assemble._RUN_MIN_BYTES <= len(long)
    runs: list[bool] = []
    run = Assembler._run
    monkeypatch.setattr(Assembler, "_run", lambda self, body: runs.append(True) or run(self, body))
    for body in (short, long):
        a = Assembler("chat")
        a.feed(body)
        assert a.done
    assert runs == [True]  # the long body only
    assert a.sent().tokens == 60 and a.sent().text == "".join(f" w{i}" for i in range(60))
