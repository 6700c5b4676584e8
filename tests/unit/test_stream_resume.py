"""Issue 20 item 2, the pure parts: what a requester received of a stream
(zmlcore.reply.resume.Received, fed as the exchange returns messages), the ``Zml-Resume``
header, the silence decision, the router's reading of it (intake, continued_from)."""

from __future__ import annotations

import doctest

import msgspec
import pytest

from zmlcore import subjects
from zmlcore.config import parse_config
from zmlcore.errors import BadRequestError
from zmlcore.messages import RoutingInfo, StreamResume, StreamStart
from zmlcore.reply import resume, streamframe
from zmlcore.reply.keepalive import after_silence
from zml_router.request import intake
from zml_router.answer import record
from zml_router.outcome import Outcome
from zml_router.request.cancels import CancelBook

START = msgspec.json.encode(StreamStart(routing=RoutingInfo(node_id="h100-a", attempts=1, continued_from="x@2:slow")))


def _chunk(text: str, finish: str | None = None, cid: str = "c1") -> bytes:
    return msgspec.json.encode({"id": cid, "created": 7, "choices": [{"index": 0, "delta": {"content": text},
                                                                     "finish_reason": finish}]})


def _events(*chunks: bytes) -> bytes:
    return b"".join(b"data: " + c + b"\n\n" for c in chunks)


def test_doctests() -> None:
    assert doctest.testmod(resume).failed == 0
    assert doctest.testmod(record).failed == 0


def test_frames_are_read_into_what_to_resume_from() -> None:
    got = resume.Received()
    assert got.resume() is None  # nothing started: a plain resend
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    got.frame(streamframe.encode(1, _events(_chunk("Hel"), _chunk("lo"))))
    got.frame(streamframe.encode(2, _events(_chunk(" wörld\n"))))
    r = got.resume()
    assert r is not None
    assert (r.text, r.tokens, r.seq, r.chunk_id, r.created, r.finished) == ("Hello wörld\n", 3, 2, "c1", 7, False)
    assert (r.node_id, r.attempts, r.continued_from) == ("h100-a", 1, "x@2:slow")
    back = resume.decode(resume.encode(r))
    assert back == r
    value = resume.encode(r)
    assert value.isascii() and "\n" not in value and "=" not in value  # one header line


def test_many_frames_are_folded_and_chunk_messages_count_too() -> None:
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    for i in range(1, 3001):
        got.frame(streamframe.encode(i, _events(_chunk("w "))))
    got.message({subjects.H_STREAM: subjects.STREAM_CHUNK, subjects.H_SEQ: "3001"}, _chunk("end", "length"))
    r = got.resume()
    assert r is not None and r.tokens == 3001 and r.seq == 3001 and r.finished and r.text.endswith("w end")


def test_a_lost_frame_resumes_from_before_it_and_numbering_goes_on() -> None:
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    got.frame(streamframe.encode(1, _events(_chunk("a "))))
    got.frame(streamframe.encode(2, _events(_chunk("b "))))
    got.frame(streamframe.encode(4, _events(_chunk("d "))))  # 3 lost: the caller has a b (then saw 4)
    got.frame(streamframe.encode(5, _events(_chunk("e "))))
    r = got.resume()
    assert r is not None and (r.text, r.tokens, r.seq) == ("a b ", 2, 2)
    got.frame(streamframe.encode(3, _events(_chunk("c "))))  # the continuation, numbered on
    got.message({subjects.H_STREAM: subjects.STREAM_CHUNK, subjects.H_SEQ: "4"}, _chunk("d "))
    r = got.resume()
    assert r is not None and (r.text, r.tokens, r.seq) == ("a b c d ", 4, 4)
    got.message({subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: "9"}, b"{}")  # an end after a gap
    r = got.resume()
    assert r is not None and r.seq == 4 and not r.finished  # not taken as the end


def test_frames_recorded_by_append_end_in_order_or_resume_from_before_a_gap() -> None:
    """The exchange records frames it hands out in a batch with ``add_frame`` (the list's
    append); the end that follows them in order ends the record without reading a chunk, and
    one that does not (a frame lost in the batch) leaves what came before it to continue from."""
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    for i in range(1, 4):
        got.add_frame(streamframe.encode(i, _events(_chunk("w "))))
    got.message({subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: "4"}, b"{}")
    assert got.ended and got.resume() is None and got._transcript is None  # nothing was read

    lost = resume.Received()
    lost.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    for i in (1, 2, 4):  # 3 lost
        lost.add_frame(streamframe.encode(i, _events(_chunk("w "))))
    lost.message({subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: "5"}, b"{}")
    r = lost.resume()
    assert not lost.ended and r is not None and (r.text, r.seq) == ("w w ", 2)


def test_frames_appended_past_the_fold_are_folded_at_the_next_frame() -> None:
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    for i in range(1, resume._FOLD_AT + 10):
        got.add_frame(streamframe.encode(i, _events(_chunk("w "))))
    got.frame(streamframe.encode(resume._FOLD_AT + 10, _events(_chunk("w "))))
    assert not got._frames and got.seq == resume._FOLD_AT + 10  # folded: the text is held, not the chunks
    r = got.resume()
    assert r is not None and r.tokens == resume._FOLD_AT + 10


def test_an_ended_stream_is_not_resumed() -> None:
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    got.message({subjects.H_STREAM: subjects.STREAM_ERROR, subjects.H_ERROR_CODE: "BACKEND_ERROR"}, b"{}")
    assert got.resume() is None


def test_tool_call_deltas_are_carried_as_the_reason_not_to_continue() -> None:
    got = resume.Received()
    got.message({subjects.H_STREAM: "start", subjects.H_SEQ: "0"}, START)
    tool = msgspec.json.encode({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    got.frame(streamframe.encode(1, _events(tool)))
    r = got.resume()
    assert r is not None and r.blocked == "tool-call deltas"


@pytest.mark.parametrize("value", ["not base64 !", "e30", resume.encode(StreamResume(tokens=-1, seq=1)),
                                   "x" * (resume.MAX_HEADER_BYTES + 1)])
def test_a_bad_header_is_a_bad_request(value: str) -> None:
    if value == "e30":  # "{}": valid, all defaults
        assert resume.decode(value) == StreamResume()
        return
    with pytest.raises(BadRequestError):
        resume.decode(value)


def test_silence_after_content_resumes_once_more_than_a_resend() -> None:
    assert after_silence(committed=True, resends=0, remaining_s=5, interval_s=1, resumable=True) == "resume"
    assert after_silence(committed=True, resends=1, remaining_s=5, interval_s=1, resumable=True) == "resume"
    assert after_silence(committed=True, resends=2, remaining_s=5, interval_s=1, resumable=True) == "fail"
    assert after_silence(committed=True, resends=0, remaining_s=0.5, interval_s=1, resumable=True) == "fail"
    assert after_silence(committed=True, resends=0, remaining_s=5, interval_s=1) == "fail"


class _Msg:
    subject = subjects.INFER
    reply = "_INBOX.x.1"

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.data, self.headers = body, headers


CFG = parse_config({"models": {"m": {}}})


def _intake(body: bytes, headers: dict[str, str]) -> intake.Intake[object]:
    return intake.intake(_Msg(body, headers), from_queue=False, cfg=CFG, max_payload=None,
                       options=lambda _: None, in_flight={}, cancels=CancelBook(), now=0.0, out=Outcome())


def test_the_router_reads_the_header_of_a_streamed_request_only() -> None:
    value = resume.encode(StreamResume(text="a b ", tokens=2, seq=3, node_id="n"))
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    got = _intake(body, {subjects.H_RESEND: "1", subjects.H_RESUME: value})
    assert got.resend and got.resume is not None and got.resume.text == "a b " and got.resume.seq == 3
    assert _intake(body, {}).resume is None
    with pytest.raises(BadRequestError):
        _intake(body.replace(b'"stream":true', b'"stream":false'), {subjects.H_RESUME: value})


def test_an_answer_resumed_starts_from_what_the_requester_has() -> None:
    answer = record.Answer()
    sent = answer.resume(StreamResume(text="a b ", tokens=2, seq=3, chunk_id="c9", created=5))
    assert answer.started and answer.seq == 3 and answer.transcript.sent() is sent
    assert (sent.text, sent.tokens, sent.chunk_id) == ("a b ", 2, "c9")
    assert record.continued_from(record.resumed_from(StreamResume(tokens=9, seq=9, node_id="b",
                                                                continued_from="a@4:network"))) == \
        "a@4:network,b@5:router"
