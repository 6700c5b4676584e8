"""An engine's error answer in words (zmlcore.reply.engineerror): every engine's shape, as the
simulated nodes imitate them and as the engines themselves write them, whole or cut short."""

from __future__ import annotations

import doctest
import json

import pytest

from zmlcore.reply import engineerror
from zmlcore.reply.engineerror import engine_error, engine_message
from zml_sim.faces import FACES

MSG = "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens."


def test_doctests() -> None:
    assert doctest.testmod(engineerror).failed == 0


@pytest.mark.parametrize("engine", sorted(FACES))
def test_each_engine_face_is_read(engine: str) -> None:
    body = json.dumps(FACES[engine].error_body(400, MSG, "bad_request"))
    message, kind = engine_message(body)
    assert message == MSG and kind and "{" not in engine_error(400, body)


@pytest.mark.parametrize(("body", "message", "kind"), [
    # SGLang and vLLM before 0.10: the error object at the top
    ('{"object":"error","message":"bad \\"quoted\\" value","type":"BadRequestError","param":null,"code":400}',
     'bad "quoted" value', "BadRequestError"),
    # llama-server's context error
    ('{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it",'
     '"type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}',
     "the request exceeds the available context size, try increasing it", "exceed_context_size_error"),
    # FastAPI's validation errors (an OpenAI-compatible server of its own make)
    ('{"detail":[{"loc":["body","max_tokens"],"msg":"Input should be a valid integer","type":"int_parsing"}]}',
     "body.max_tokens: Input should be a valid integer", ""),
    ('{"detail":"Not Found"}', "Not Found", ""),
    # not JSON, or JSON of no known shape: as it came
    ("Bad Gateway\n", "Bad Gateway", ""),
    ('["odd"]', '["odd"]', ""),
    ('{"status":"bad"}', '{"status":"bad"}', ""),
])
def test_shapes(body: str, message: str, kind: str) -> None:
    assert engine_message(body) == (message, kind)


def test_a_body_cut_at_500_bytes_keeps_its_message_so_far() -> None:
    body = json.dumps({"error": {"message": "x" * 600 + " end", "type": "BadRequestError", "code": 400}})[:500]
    message, kind = engine_message(body)
    assert message == "x" * (500 - len('{"error": {"message": "')) + "..." and kind == ""
    cut = '{"object": "error", "message": "short \\u00e9", "type": "BadRequestError", "param": null, "co'
    assert engine_message(cut) == ("short é", "BadRequestError")
