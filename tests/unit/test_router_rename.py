"""The reply's ``model`` is the name the client asked for (issue 10 item 2): the router's
targeted rewrite of the engine's name, on bodies shaped as real engines send them."""

from __future__ import annotations

import json

from zml_router.node.attempt import Renamer

ENGINE = "/models/Meta-Llama-3-8B-Instruct.Q4_K_M.gguf"
ASKED = "meta-llama/llama-3-8b-instruct"


def test_vllm_style_body() -> None:
    body = json.dumps({"id": "c", "object": "chat.completion", "model": ENGINE,
                       "choices": [{"message": {"content": "the model said \"model\": x"}}]}).encode()
    out = json.loads(Renamer(ENGINE, ASKED)(body))
    assert out["model"] == ASKED
    assert out["choices"][0]["message"]["content"] == 'the model said "model": x'


def test_llamacpp_style_compact_body_with_model_last() -> None:
    body = (b'{"choices":[{"delta":{"content":"model"}}],"created":1,"id":"x",'
            b'"model":"' + ENGINE.encode() + b'","object":"chat.completion.chunk"}')
    assert json.loads(Renamer(ENGINE, ASKED)(body))["model"] == ASKED


def test_whitespace_around_the_colon() -> None:
    body = b'{ "model" :\n "' + ENGINE.encode() + b'" }'
    assert json.loads(Renamer(ENGINE, ASKED)(body)) == {"model": ASKED}


def test_escaped_slashes_fall_back_to_a_decode() -> None:
    body = b'{"model":"' + ENGINE.replace("/", "\\/").encode() + b'","choices":[]}'
    assert json.loads(Renamer(ENGINE, ASKED)(body)) == {"model": ASKED, "choices": []}


def test_other_names_and_bodies_without_model_are_untouched() -> None:
    r = Renamer(ENGINE, ASKED)
    other = b'{"model":"something-else","choices":[]}'
    assert r(other) is other or r(other) == other
    no_model = b'{"choices":[],"usage":{"total_tokens":3}}'
    assert r(no_model) == no_model
    assert r(b"not json") == b"not json"


def test_a_block_of_events_reports_its_last_usage() -> None:
    # vLLM's continuous_usage_stats puts the running usage on every chunk: a relayed block of
    # several is worth its last (the first undercounted the answer's tokens).
    from zml_router.node.attempt import stream_usage
    block = b"".join(b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":5,'
                     b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (n, 5 + n) for n in (1, 2, 3))
    assert stream_usage(block) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert stream_usage(b'{"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}')["total_tokens"] == 6
    assert stream_usage(b'data: {"choices":[]}\n\n') is None
