"""zml_router.answer.continuation: what was sent, whether it may be continued, the continuation's body
for each engine, and the splice of its chunks into the stream the caller reads. No I/O."""

from __future__ import annotations

import json
from typing import Any

import pytest

from zml_router.answer import continuation as c
from zml_router.answer.continuation import Splice
from zmlcore.reply.transcript import Sent, Transcript


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None, cid: str = "chatcmpl-1",
          usage: dict[str, int] | None = None, **delta: Any) -> bytes:
    d: dict[str, Any] = {}
    if role:
        d["role"] = "assistant"
    if content is not None:
        d["content"] = content
    d.update(delta)
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": 11, "model": "m",
                            "choices": [] if usage else [{"index": 0, "delta": d, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return json.dumps(body).encode()


def events(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


# --- what was sent -------------------------------------------------------------------------------

def test_the_transcript_reads_what_went_out_in_either_framing() -> None:
    t = Transcript()
    t.begin(True)  # the gateway's relayed events: several per block
    t.add(events(chunk("", role=True), chunk("The "), chunk("cat ")))
    t.begin(False)  # a continuation relayed payload by payload
    t.add(chunk("sat "))
    sent = t.sent()
    assert (sent.text, sent.tokens, sent.chunk_id, sent.created) == ("The cat sat ", 3, "chatcmpl-1", 11)
    assert not sent.finished and not sent.usage and sent.blocked is None
    t.add(chunk(finish="stop"))
    t.add(chunk(usage={"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}))
    sent = t.sent()
    assert sent.finished and sent.usage and sent.text == "The cat sat "


@pytest.mark.parametrize(("delta", "why"), [
    ({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, "tool-call"),
    ({"reasoning_content": "hmm"}, "reasoning"),
])
def test_deltas_that_cannot_be_continued_block_it(delta: dict[str, Any], why: str) -> None:
    s = Sent()
    s.read(chunk(**delta))
    assert s.blocked is not None and why in s.blocked


def test_an_engines_error_event_is_recognised() -> None:
    err = events(json.dumps({"error": {"message": "CUDA out of memory", "code": 500}}).encode())
    assert c.engine_error(err) == "CUDA out of memory"
    assert c.engine_error(events(chunk('a "error" in the text'))) is None


# --- may it continue -----------------------------------------------------------------------------

def test_a_plain_chat_may_be_continued_and_the_blocks_are_named() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'
    assert c.refusal(raw, asked=None, policy_allows=True, pinned=False, sent=Sent(tokens=2)) is None
    assert "tool-call" in str(c.refusal(raw, asked=None, policy_allows=True, pinned=False,
                                        sent=Sent(blocked="tool-call deltas")))
    assert c.refusal(raw, asked=True, policy_allows=False, pinned=False) is not None
    assert c.refusal(raw.replace(b'"max_tokens"', b'"continue_on_failure":false,"max_tokens"'), asked=None,
                     policy_allows=True, pinned=False) is not None


def test_a_trailing_assistant_message_is_continued_only_when_the_caller_continues_it() -> None:
    msgs = '[{"role":"user","content":"hi"},{"role":"assistant","content":"Sure"}]'
    raw = f'{{"model":"m","messages":{msgs}}}'.encode()
    assert "assistant message" in str(c.refusal(raw, asked=None, policy_allows=True, pinned=False))
    ok = raw.replace(b'"messages"', b'"continue_final_message":true,"messages"')
    assert c.refusal(ok, asked=None, policy_allows=True, pinned=False) is None


def test_remaining_tokens() -> None:
    assert c.max_asked(b'{"max_tokens":9}') == 9
    assert c.max_asked(b'{"max_tokens":9,"max_completion_tokens":5}') == 5
    assert c.max_asked(b'{}') is None
    assert c.remaining(9, Sent(tokens=4)) == 5 and c.remaining(None, Sent(tokens=4)) is None


# --- the continuation's body ---------------------------------------------------------------------

CHAT = {"model": "asked", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "min_tokens": 4, "stream": True, "policy": "p", "request_id": "r1"}


@pytest.mark.parametrize(("backend", "flags"), [
    ("vllm", {"continue_final_message": True, "add_generation_prompt": False}),
    ("sglang", {"continue_final_message": True}),
    ("tgi", {"continue_final_message": True}),
    ("llamacpp", {}),  # llama-server's assistant prefill: on by default
])
def test_each_engine_is_asked_its_own_way(backend: str, flags: dict[str, Any]) -> None:
    sent = Sent(text="The cat ", tokens=2)
    out = json.loads(c.body(json.dumps(CHAT).encode(), clean=False, kind="chat", sent=sent, backend=backend,
                            name="engine-name"))
    assert out["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The cat "}]
    assert out["max_tokens"] == 8 and out["min_tokens"] == 2 and out["model"] == "engine-name"
    assert "policy" not in out and "request_id" not in out  # ZML's own fields stay out
    for key in ("continue_final_message", "add_generation_prompt"):
        assert out.get(key) == flags.get(key)


def test_a_caller_prefill_grows_and_completions_append_to_the_prompt() -> None:
    raw = json.dumps({**CHAT, "continue_final_message": True, "add_generation_prompt": False,
                      "messages": [*CHAT["messages"], {"role": "assistant", "content": "Once "}]}).encode()
    out = json.loads(c.body(raw, clean=True, kind="chat", sent=Sent(text="upon ", tokens=1), backend="vllm", name="m"))
    assert out["messages"][-1] == {"role": "assistant", "content": "Once upon "} and len(out["messages"]) == 2
    comp = json.dumps({"model": "m", "prompt": ["Tell: "], "max_tokens": 5, "stream": False}).encode()
    out = json.loads(c.body(comp, clean=True, kind="completion", sent=Sent(text="a b ", tokens=2), backend="tgi",
                            name="m", usage=True))
    assert out["prompt"] == ["Tell: a b "] and out["max_tokens"] == 3
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}


def test_nothing_sent_but_the_role_asks_again_as_it_was() -> None:
    out = json.loads(c.body(json.dumps(CHAT).encode(), clean=False, kind="chat", sent=Sent(), backend="vllm",
                            name="asked"))
    assert out["messages"] == CHAT["messages"] and "continue_final_message" not in out


# --- the splice ----------------------------------------------------------------------------------

def test_the_splice_makes_one_stream() -> None:
    sent = Sent(text="The cat ", tokens=2, chunk_id="chatcmpl-first", created=7)
    sp = Splice(sent, {"attempts": 2, "continued_from": "a@2:network"})
    assert sp.payload(chunk("", role=True, cid="other")) is None  # the role, announced again
    assert sp.payload(chunk(None, role=True, cid="other")) is None  # llama-server's spelling
    got = json.loads(sp.payload(chunk("sat ", cid="other")) or b"")
    assert got["id"] == "chatcmpl-first" and got["created"] == 7 and got["choices"][0]["delta"] == {"content": "sat "}
    end = json.loads(sp.payload(chunk(finish="length", cid="other")) or b"")
    assert end["choices"][0]["finish_reason"] == "length" and end["zml"]["continued_from"] == "a@2:network"
    usage = json.loads(sp.payload(chunk(usage={"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}))
                       or b"")["usage"]
    # Its prompt held the 2 tokens sent: the first attempt's prompt, and both attempts' output.
    assert usage == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    block = events(chunk("", role=True), chunk("on "), chunk("the "))
    assert c.event_payloads(sp.events(block))[0] == sp.payload(chunk("on "))
    assert len(c.event_payloads(sp.events(block))) == 2


def test_spliced_usage_keeps_cached_tokens_within_the_prompt() -> None:
    u = c.spliced_usage({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                         "prompt_tokens_details": {"cached_tokens": 9}}, Sent(tokens=4))
    assert u["prompt_tokens"] == 6 and u["completion_tokens"] == 7 and u["prompt_tokens_details"]["cached_tokens"] == 6
