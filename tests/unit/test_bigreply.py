"""zmlcore.reply.bigreply: replies over max_payload in parts, the collector's checks, the bound."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from zmlcore import subjects
from zmlcore.reply.bigreply import (
    ASSUMED_MAX_MODEL_LEN,
    Collector,
    accepted,
    check_fits,
    part_bytes,
    plan,
    reply_bound,
    split,
)
from zmlcore.errors import ReplyIncompleteError, ReplyTooLargeError
from zmlcore.messages import InferRequest

HEADERS = {subjects.H_NODE_ID: "n1", subjects.H_REQUEST_ID: "r1"}


def _req(**body: Any) -> tuple[bytes, InferRequest]:
    raw = json.dumps({"model": "m", **body}).encode()
    return raw, msgspec.json.decode(raw, type=InferRequest)


def test_a_reply_that_fits_is_one_message_without_part_headers() -> None:
    assert plan(b"x" * 100, HEADERS, 8192, None) == [(b"x" * 100, HEADERS)]
    assert plan(b"x" * part_bytes(8192), HEADERS, 8192, 10) == [(b"x" * part_bytes(8192), HEADERS)]


def test_parts_fit_max_payload_and_join_back() -> None:
    data = bytes(range(256)) * 1000  # 256,000 bytes in parts of 61,440
    parts = plan(data, HEADERS, 65536, 1 << 20)
    assert len(parts) == 5 and all(len(d) + 4096 <= 65536 for d, _ in parts)
    assert [h[subjects.H_PART] for _, h in parts] == ["1", "2", "3", "4", "5"]
    assert {h[subjects.H_PARTS] for _, h in parts} == {"5"}
    assert parts[0][1][subjects.H_NODE_ID] == "n1" and subjects.H_NODE_ID not in parts[1][1]
    c = Collector(1 << 20)
    out = [c.feed(d, h) for d, h in parts]
    assert out[:4] == [None] * 4 and out[4] == data and c.headers[subjects.H_NODE_ID] == "n1"


def test_a_requester_that_does_not_declare_parts_gets_an_error_not_a_lost_reply() -> None:
    with pytest.raises(ReplyTooLargeError, match=subjects.H_ACCEPT_PARTS):
        plan(b"x" * 10_000, HEADERS, 8192, None)
    with pytest.raises(ReplyTooLargeError, match="limit of 9000"):
        plan(b"x" * 10_000, HEADERS, 8192, 9000)


@pytest.mark.parametrize("value, expected", [("1048576", 1048576), ("", None), ("0", None), ("-5", None),
                                             ("1e9", None), ("9" * 40, None), ("yes", None)])
def test_accept_parts_header_is_parsed_strictly(value: str, expected: int | None) -> None:
    assert accepted({subjects.H_ACCEPT_PARTS: value}) == expected
    assert accepted(None) is None


def _parts(n: int = 4) -> list[tuple[bytes, dict[str, str]]]:
    return split(b"abcdefgh" * n, HEADERS, 8)


@pytest.mark.parametrize("lost", [0, 1, 2], ids=["first", "middle", "second-last"])
def test_a_lost_part_is_an_error_never_a_truncated_body(lost: int) -> None:
    c = Collector(1000)
    parts = _parts()
    del parts[lost]
    with pytest.raises(ReplyIncompleteError, match="lost") as err:
        for d, h in parts:
            assert c.feed(d, h) is None
    assert err.value.retryable and err.value.code == "REPLY_INCOMPLETE"


def test_a_lost_last_part_is_reported_by_the_caller_after_the_wait() -> None:
    c = Collector(1000)
    for d, h in _parts()[:-1]:
        assert c.feed(d, h) is None
    assert c.started and "part 4 of 4" in str(c.lost())


def test_the_collector_holds_at_most_max_bytes() -> None:
    c = Collector(20)
    with pytest.raises(ReplyTooLargeError):
        for d, h in _parts():
            c.feed(d, h)
    assert c.size <= 24  # stopped at the part that crossed the limit


@pytest.mark.parametrize("headers", [
    {subjects.H_PART: "1", subjects.H_PARTS: "1"},          # "parts" of one
    {subjects.H_PART: "1", subjects.H_PARTS: "x"},
    {subjects.H_PART: "1", subjects.H_PARTS: "99999999"},   # more parts than bytes allowed
    {subjects.H_PART: "2", subjects.H_PARTS: "3"},          # part 1 lost
], ids=["one", "garbage", "huge-n", "starts-at-2"])
def test_malformed_part_headers_are_an_error(headers: dict[str, str]) -> None:
    with pytest.raises(ReplyIncompleteError):
        Collector(1000).feed(b"x", headers)


def test_an_unnumbered_message_mid_reply_is_an_error() -> None:
    c = Collector(1000)
    d, h = _parts()[0]
    c.feed(d, h)
    with pytest.raises(ReplyIncompleteError):
        c.feed(b"{}", {subjects.H_ERROR_CODE: "TIMEOUT"})


def test_the_bound_grows_with_tokens_choices_logprobs_and_inputs() -> None:
    base = reply_bound(*_req(messages=[], max_tokens=1000), None)
    assert reply_bound(*_req(messages=[], max_tokens=10000), None) > base * 5
    assert reply_bound(*_req(messages=[], max_tokens=1000, n=10), None) > base * 5
    assert reply_bound(*_req(messages=[], max_tokens=1000, logprobs=True, top_logprobs=20), None) > base * 10
    assert reply_bound(*_req(prompt="p", max_tokens=1000, logprobs=5), None) > base * 5
    # No max_tokens: the model's context window, else the assumed one.
    assert reply_bound(*_req(messages=[]), 1000) == reply_bound(*_req(messages=[], max_tokens=1000), None)
    assert reply_bound(*_req(messages=[]), None) == reply_bound(*_req(messages=[], max_tokens=ASSUMED_MAX_MODEL_LEN), None)
    one = reply_bound(*_req(input="a"), None)
    assert reply_bound(*_req(input=["a"] * 100), None) > one * 90
    assert reply_bound(*_req(input=[1, 2, 3]), None) == one  # token ids: one input
    assert reply_bound(*_req(input=["a"] * 100, dimensions=8), None) < one * 10
    assert reply_bound(*_req(input=["a"] * 100, encoding_format="base64"), None) < reply_bound(*_req(input=["a"] * 100), None) / 3


def test_the_bound_survives_hostile_shapes() -> None:
    assert reply_bound(*_req(messages=[], max_tokens=10, n="many", logprobs="x"), None) > 0
    assert reply_bound(*_req(messages=[], max_tokens=10, n=-5), None) == reply_bound(*_req(messages=[], max_tokens=10), None)


def test_check_fits_refuses_only_undeclared_non_streamed_requests_that_could_be_too_big() -> None:
    raw, req = _req(input=["a"] * 500)
    with pytest.raises(ReplyTooLargeError, match=subjects.H_ACCEPT_PARTS):
        check_fits(raw, req, {}, 1 << 20, None)
    check_fits(raw, req, {subjects.H_ACCEPT_PARTS: "100000000"}, 1 << 20, None)
    small_raw, small = _req(input=["a"] * 5)
    check_fits(small_raw, small, {}, 1 << 20, None)
    stream_raw, stream = _req(messages=[], max_tokens=1_000_000, stream=True)
    check_fits(stream_raw, stream, {}, 1 << 20, None)  # streamed chunks are small messages
