"""The gateway's stream relay (zml_gateway.infer.relay), without a network: every message kind,
every way a stream ends (before and after its head), and what it records of the text sent."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from zmlcore import subjects
from zmlcore.errors import BackendError, StreamInterruptedError, TimeoutError
from zmlcore.messages import RoutingInfo, StreamStart
from zmlcore.reply import streamframe
from zml_gateway.infer.relay import (
    DONE,
    SSE_HEADERS,
    Continue,
    Fail,
    Finish,
    Refuse,
    Start,
    StreamRelay,
)

LIMITS = [(b"x-ratelimit-limit-requests", b"60")]
INFO = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="latency",
                   queue_depth_at_dispatch=0, decision_id="d1", request_id="r1")


def event(content: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": content}}]}).encode() + b"\n\n"


def start_msg(seq: int | None = 0) -> tuple[dict[str, str], bytes]:
    headers = {subjects.H_STREAM: "start"}
    if seq is not None:
        headers[subjects.H_SEQ] = str(seq)
    return headers, msgspec.json.encode(StreamStart(routing=INFO))


def end_msg(seq: int, total: int = 42) -> tuple[dict[str, str], bytes]:
    usage = {"usage": {"prompt_tokens": 2, "completion_tokens": total - 2, "total_tokens": total}}
    return {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(seq)}, json.dumps(usage).encode()


def nothing_waiting() -> None:
    return None


def waiting(*frames: bytes):  # type: ignore[no-untyped-def]
    """``more`` for StreamRelay.frames: these frames are already in the buffer, then nothing."""
    it = iter([SimpleNamespace(data=f) for f in frames])
    return lambda: next(it, None)


def started() -> StreamRelay:
    r = StreamRelay(LIMITS)
    action = r.message(*start_msg())
    assert isinstance(action, Start)
    return r


def sse_error(action: object) -> dict:  # type: ignore[type-arg]
    """The error event that ends a started stream."""
    assert isinstance(action, Finish) and action.body is not None
    last = action.body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: ")
    return json.loads(last[len(b"data: "):])["error"]  # type: ignore[no-any-return]


# --- the way through ------------------------------------------------------------------------
def test_a_whole_stream_start_frames_end() -> None:
    r = StreamRelay(LIMITS)
    action = r.message(*start_msg())
    assert isinstance(action, Start) and r.started
    assert action.headers[:3] == SSE_HEADERS
    assert action.headers[3] == LIMITS[0]
    assert (b"x-zml-node-id", b"n1") in action.headers and (b"x-zml-request-id", b"r1") in action.headers
    assert r.frames(streamframe.encode(1, event("Hel")), nothing_waiting) == event("Hel")
    assert r.frames(streamframe.encode(2, event("lo")), nothing_waiting) == event("lo")
    action = r.message(*end_msg(3, total=42))
    assert action == Finish(DONE, cancel=False) and r.done
    assert r.total_tokens == 42


def test_frames_waiting_behind_one_go_out_in_one_write() -> None:
    r = started()
    more = waiting(streamframe.encode(2, event("b")), streamframe.encode(3, event("c")))
    assert r.frames(streamframe.encode(1, event("a")), more) == event("a") + event("b") + event("c")
    assert r.frames(streamframe.encode(4, event("d")), nothing_waiting) == event("d")


def test_routing_from_start_headers_when_the_router_sends_them() -> None:
    r = StreamRelay([])
    headers = {subjects.H_STREAM: "start", subjects.H_SEQ: "0", subjects.H_NODE_ID: "n9", subjects.H_FAMILY: "MI300X"}
    action = r.message(headers, b"")
    assert isinstance(action, Start)
    assert action.headers == [*SSE_HEADERS, (b"x-zml-node-id", b"n9"), (b"x-zml-family", b"MI300X")]


def test_events_and_chunk_messages_of_an_older_router() -> None:
    r = started()
    assert r.message({subjects.H_STREAM: subjects.STREAM_EVENTS, subjects.H_SEQ: "1"}, event("a")) == event("a")
    chunk = json.dumps({"choices": [{"index": 0, "text": "b"}]}).encode()
    assert r.message({subjects.H_STREAM: subjects.STREAM_CHUNK, subjects.H_SEQ: "2"}, chunk) == \
        b"data: " + chunk + b"\n\n"
    # no Zml-Seq (a router before sequence numbers): not checked
    assert r.message({subjects.H_STREAM: subjects.STREAM_EVENTS}, event("c")) == event("c")


def test_a_keepalive_that_reaches_the_relay_changes_nothing() -> None:
    r = StreamRelay(LIMITS)
    assert r.message({subjects.H_KEEPALIVE: "alive"}, b"") is None
    assert not r.started and not r.done
    assert isinstance(r.message(*start_msg()), Start)  # the sequence still expects 0


# --- the router's own error ends it -----------------------------------------------------------
def test_an_error_before_the_head_is_the_routers_answer_relayed() -> None:
    r = StreamRelay(LIMITS)
    body = b'{"error":{"message":"busy","type":"server_error","code":"QUEUE_FULL"}}'
    action = r.message({subjects.H_STREAM: subjects.STREAM_ERROR, subjects.H_ERROR_CODE: "QUEUE_FULL",
                        subjects.H_RETRY_AFTER: "0.2"}, body)
    assert isinstance(action, Refuse) and r.done
    assert action.status == 503 and action.body == body  # QUEUE_FULL's status
    assert (b"retry-after", b"1") in action.headers and LIMITS[0] in action.headers
    assert (b"content-length", str(len(body)).encode()) in action.headers


def test_an_error_without_body_or_code_still_says_what_it_is() -> None:
    action = StreamRelay([]).message({subjects.H_STREAM: subjects.STREAM_ERROR}, b"")
    assert isinstance(action, Refuse) and action.status == 500
    assert json.loads(action.body)["error"]["code"] == "INTERNAL"


def test_an_error_after_the_head_is_the_streams_last_event_as_the_router_wrote_it() -> None:
    r = started()
    body = b'{"error":{"message":"node died","type":"server_error","code":"STREAM_INTERRUPTED"}}'
    action = r.message({subjects.H_STREAM: subjects.STREAM_ERROR, subjects.H_ERROR_CODE: "STREAM_INTERRUPTED"}, body)
    assert action == Finish(b"data: " + body + b"\n\n", cancel=False)  # the router ended it: no cancel


# --- the six ways the gateway ends it: before the head an HTTP error, after it an SSE event -----
@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
def test_the_broker_lost(head: bool) -> None:
    r = started() if head else StreamRelay(LIMITS)
    action = r.broker_lost()
    assert r.done
    if head:
        assert sse_error(action)["code"] == "STREAM_INTERRUPTED" and action.cancel  # type: ignore[union-attr]
        assert "broker connection was lost mid-stream" in sse_error(action)["message"]
    else:
        assert isinstance(action, Fail) and action.cancel
        assert action.error.code == "CONNECTION_FAILED" and action.error.retry_after == 0.5


@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
@pytest.mark.parametrize("error", [
    TimeoutError("no reply within 30 s"),  # the deadline
    BackendError("the router handling this request sent nothing for 3.0 s; retry", retry_after=1.0),
    StreamInterruptedError("the router relaying this stream sent nothing for 3.0 s", retry_after=1.0),
], ids=["deadline", "router-gone", "router-gone-mid-stream"])
def test_the_wait_failed(head: bool, error: Exception) -> None:
    r = started() if head else StreamRelay(LIMITS)
    action = r.failed(error)  # type: ignore[arg-type]
    if head:
        assert action.cancel and sse_error(action)["code"] == error.code  # type: ignore[union-attr,attr-defined]
    else:
        assert action == Fail(error, cancel=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
def test_the_client_reads_too_slowly(head: bool) -> None:
    r = started() if head else StreamRelay(LIMITS)
    action = r.overflowed(64)
    if head:
        assert action.cancel and sse_error(action)["code"] == "BACKEND_ERROR"  # type: ignore[union-attr]
        assert "more than 64 chunks waiting" in sse_error(action)["message"]
    else:
        assert isinstance(action, Fail) and action.cancel and action.error.code == "BACKEND_ERROR"


@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
def test_a_frame_lost(head: bool) -> None:
    r = started() if head else StreamRelay(LIMITS)
    if head:
        # frame 2 of 1, 2, 3 never came: 1 is written, then the stream is continued from there
        cont = r.frames(streamframe.encode(1, event("a")), waiting(streamframe.encode(3, event("c"))))
        assert isinstance(cont, Continue) and cont.body == event("a") and not r.done
        # ... by another router, numbering on from 1 (the exchange sent it Zml-Resume)
        assert r.frames(streamframe.encode(2, event("b")), nothing_waiting) == event("b")
        # ... and where it cannot be continued, it ends with the loss
        cont = r.frames(streamframe.encode(4, event("d")), nothing_waiting)
        assert isinstance(cont, Continue) and cont.body == b""
        action = r.lost(cont)
        assert isinstance(action, Finish) and action.cancel and r.done
        assert sse_error(action)["code"] == "STREAM_INTERRUPTED"
        assert "stream message 3 was lost" in sse_error(action)["message"]
    else:
        action = r.frames(streamframe.encode(1, event("a")), nothing_waiting)  # the start (0) was lost
        assert isinstance(action, Fail) and action.cancel and action.error.code == "STREAM_INTERRUPTED"


@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
def test_no_responders(head: bool) -> None:
    r = started() if head else StreamRelay(LIMITS)
    action = r.message({"Status": "503"}, b"")
    if head:
        assert not action.cancel and sse_error(action)["code"] == "NO_HEALTHY_NODES"  # type: ignore[union-attr]
    else:  # nothing received the request: nothing to cancel
        assert isinstance(action, Fail) and not action.cancel
        assert action.error.code == "NO_HEALTHY_NODES" and action.error.retry_after == 1.0


@pytest.mark.parametrize("head", [False, True], ids=["before-head", "after-head"])
def test_a_sequence_gap_on_a_message_with_headers(head: bool) -> None:
    r = started() if head else StreamRelay(LIMITS)
    if head:
        cont = r.message(*end_msg(2))  # 1 lost
        assert isinstance(cont, Continue) and r.total_tokens == 0  # the end was not taken
        action = r.lost(cont)
        assert action.cancel and sse_error(action)["code"] == "STREAM_INTERRUPTED"  # type: ignore[union-attr]
    else:
        action = r.message(*start_msg(seq=1))  # 0 lost
        assert isinstance(action, Fail) and action.cancel and action.error.code == "STREAM_INTERRUPTED"
        assert not r.started


def test_an_invalid_sequence_number_is_a_gap() -> None:
    r = started()
    cont = r.message({subjects.H_STREAM: subjects.STREAM_EVENTS, subjects.H_SEQ: "x"}, event("a"))
    assert isinstance(cont, Continue)
    assert "invalid sequence number" in sse_error(r.lost(cont))["message"]


def test_the_client_gone_cancels_and_writes_nothing() -> None:
    for r in (StreamRelay(LIMITS), started()):
        assert r.client_gone() == Finish(None, cancel=True) and r.done


# --- a router that breaks the protocol --------------------------------------------------------
def test_a_garbled_frame_ends_the_stream() -> None:
    r = started()
    action = r.frames(b"not a frame", nothing_waiting)
    assert action.cancel and sse_error(action)["code"] == "BACKEND_ERROR"  # type: ignore[union-attr]


def test_content_before_the_start_is_refused_not_written_before_the_head() -> None:
    r = StreamRelay(LIMITS)
    action = r.frames(streamframe.encode(0, event("a")), nothing_waiting)  # numbered as the start
    assert isinstance(action, Fail) and action.cancel and action.error.code == "BACKEND_ERROR"
    for kind in (subjects.STREAM_EVENTS, subjects.STREAM_CHUNK, subjects.STREAM_END):
        r = StreamRelay(LIMITS)
        action = r.message({subjects.H_STREAM: kind}, event("a"))  # no Zml-Seq: the sequence cannot tell
        assert isinstance(action, Fail) and action.cancel and action.error.code == "BACKEND_ERROR"
        assert "before the stream's start" in str(action.error) and r.done


def test_a_second_start_ends_the_stream() -> None:
    r = started()
    action = r.message(*start_msg(seq=None))  # no number: the sequence cannot tell
    assert action.cancel and sse_error(action)["code"] == "BACKEND_ERROR"  # type: ignore[union-attr]


def test_an_slo_no_node_would_meet_is_answered_without_an_invitation_to_retry() -> None:
    # OpenAI's clients retry every 503 unless told ``x-should-retry: false``; an SLO that not even
    # an idle fleet meets (no Retry-After) cannot be met by asking again.
    from zml_gateway.infer.replies import error_answer
    status, _, headers = error_answer("SLO_UNATTAINABLE", b"", None, [])
    assert status == 503 and (b"x-should-retry", b"false") in headers
    status, _, headers = error_answer("SLO_UNATTAINABLE", b"", "2.5", [])
    assert (b"retry-after", b"3") in headers and not any(k == b"x-should-retry" for k, _ in headers)
    _, _, headers = error_answer("QUEUE_FULL", b"", None, [])
    assert not any(k == b"x-should-retry" for k, _ in headers)
