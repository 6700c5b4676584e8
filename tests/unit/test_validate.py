"""zmlcore.messages.validate: the front door's rules, shared by the gateway and the router."""

from __future__ import annotations

import json

import msgspec
import pytest

from zmlcore.errors import BadRequestError, ErrorBody, ZMLError, error_class, from_wire
from zmlcore.messages.validate import (
    MAX_REQUEST_ID,
    check_request_id,
    clip,
    decode_request,
    json_depth,
    request_timeout_s,
)

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _bad(body: object) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(BadRequestError) as info:
        decode_request(raw)
    assert len(info.value.message) < 400  # never echoes unbounded input
    return info.value.message


def test_valid_requests_pass() -> None:
    assert decode_request(json.dumps(OK).encode()).model == "m"
    parts = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}}]}]}
    assert decode_request(json.dumps(parts).encode()).messages is not None
    assert decode_request(b'{"model": "m", "prompt": ["a", "b"], "request_id": "abc-1:2_3"}').prompt == ["a", "b"]


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
def test_deep_nesting_is_a_400_not_a_recursion_error(depth: int) -> None:
    raw = b'{"model": "m", "prompt": "x", "junk": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nested deeper" in _bad(raw)


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert json_depth(b'{"a": "[[[{{{\\"]]]", "b": [[1]]}') == 3
    assert json_depth(b'"x"') == 0
    assert json_depth(b"[" * 50 + b"]" * 50) == 50


@pytest.mark.parametrize("part", [{"type": "text", "text": 5}, {"type": "text", "text": None},
                                  {"type": "text", "text": ["a"]}, {"type": "text"}, {"type": "nope", "text": "x"},
                                  "just a string", 7, {"text": "no type"}])
def test_content_parts_follow_openais_schema(part: object) -> None:
    _bad({"model": "m", "messages": [{"role": "user", "content": [part]}]})


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": []},
    {"model": "m", "messages": [{"role": "hacker", "content": "x"}]},
    {"model": "m", "messages": [{"content": "x"}]},
    {"model": "m", "messages": [{"role": "user", "content": 5}]},
    {"model": "m", "prompt": []},
    {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
    {"model": "m"},
    {"model": "", "prompt": "x"},
    {"model": "m", "prompt": "x", "max_tokens": 0},
    {"model": "m", "prompt": "x", "max_tokens": "many"},
    {"model": "m", "prompt": "x", "temperature": -1},
    {"model": "m", "prompt": "x", "stream": "yes"},
    [1, 2],
    "str",
])
def test_schema_violations_are_400(body: object) -> None:
    _bad(body)


def test_huge_model_name_is_refused_with_a_short_message() -> None:
    message = _bad({"model": "a" * 600_000, "prompt": "x"})
    assert "600002 chars" in message


@pytest.mark.parametrize("rid", ["a b", "a.b", "a*", ">", "é", "a\x00", "a\r\nX-Evil: 1", "", "x" * (MAX_REQUEST_ID + 1),
                                 "x" * 600_000])
def test_bad_request_ids(rid: str) -> None:
    with pytest.raises(BadRequestError) as info:
        check_request_id(rid)
    assert len(info.value.message) < 300
    _bad({"model": "m", "prompt": "x", "request_id": rid})


def test_timeouts() -> None:
    assert request_timeout_s(None, None, 30, 600) == 30
    assert request_timeout_s(None, None, 900, 600) == 600
    assert request_timeout_s(5000, None, 30, 600) == 5
    assert request_timeout_s(5000, "2000", 30, 600) == 2
    for header in ("0", "-5", "abc", "1e3"):
        with pytest.raises(BadRequestError):
            request_timeout_s(None, header, 30, 600)
    with pytest.raises(BadRequestError, match="cap"):
        request_timeout_s(600_001, None, 30, 600)


def test_clip() -> None:
    assert clip("abc") == "'abc'"
    assert clip("x" * 1000, 20).endswith("(1002 chars)")


@pytest.mark.parametrize("cls", [ZMLError, error_class("BACKEND_ERROR"), error_class("TIMEOUT"),
                                 error_class("NO_HEALTHY_NODES")])
def test_5xx_bodies_keep_openais_type(cls: type[ZMLError]) -> None:
    body = json.loads(msgspec.json.encode(cls("boom").to_body()))
    assert body["error"]["type"] == cls.openai_type and body["error"]["code"] == cls.code
    back = from_wire(msgspec.json.decode(msgspec.json.encode(cls("boom").to_body()), type=ErrorBody).error)
    assert type(back) is cls


def test_a_body_without_code_is_internal() -> None:
    back = from_wire(msgspec.json.decode(b'{"error": {"message": "x"}}', type=ErrorBody).error)
    assert back.code == "INTERNAL" and back.http_status == 500


def test_deeper_than_agrees_with_json_depth() -> None:
    from zmlcore.messages.validate import deeper_than

    for raw in (b'{"a": "[[[{{{\\"]]]", "b": [[1]]}', b'"x"', b"[" * 50 + b"]" * 50, b"[" * 3 + b"]" * 3,
                b'{"m": [{"a": 1}, {"b": [2]}, {"c": {}}]}', b"[[" + b"1," * 40 + b"]]"):
        for limit in range(0, 60, 3):
            assert deeper_than(raw, limit) == (json_depth(raw) > limit), (raw[:40], limit)
