"""SSE lines end at CR, LF or CRLF only (issue 10 item 1): never at U+2028, U+2029, U+0085 or
the other characters str.splitlines() (and httpx's iter_lines) treat as line ends."""

from __future__ import annotations

import asyncio

import pytest

from zml._core import SSEDecoder
from zmlcore.reply.sse import SSELineSplitter, SSELineTooLong, aiter_sse_lines, data_field, iter_sse_lines

# Legal raw in a JSON string (JSON escapes only U+0000..U+001F), and line ends to splitlines().
SEPARATORS = "\u2028\u2029\u0085"
EVENT = ('data: {"choices":[{"delta":{"content":"a' + SEPARATORS + 'b"}}]}').encode()


def test_unicode_separators_stay_inside_the_line() -> None:
    assert len(EVENT.decode().splitlines()) == 4  # what a generic splitter would do
    assert list(iter_sse_lines([EVENT + b"\n\n"])) == [EVENT, b""]


def test_other_splitlines_breaks_are_not_line_ends_either() -> None:
    line = "data: a\x0b\x0c\x1c\x1d\x1eb".encode()
    assert list(iter_sse_lines([line + b"\n"])) == [line]


@pytest.mark.parametrize("end", [b"\n", b"\r", b"\r\n"])
def test_each_spec_line_end(end: bytes) -> None:
    stream = EVENT + end + end + b"data: [DONE]" + end + end
    assert list(iter_sse_lines([stream])) == [EVENT, b"", b"data: [DONE]", b""]


def test_any_chunking_gives_the_same_lines() -> None:
    stream = EVENT + b"\r\n\r\n" + EVENT + b"\r\rdata: [DONE]\n\n"
    want = list(iter_sse_lines([stream]))
    assert want == [EVENT, b"", EVENT, b"", b"data: [DONE]", b""]
    for size in (1, 2, 3, 7, 64):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert list(iter_sse_lines(chunks)) == want, size


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    s = SSELineSplitter()
    assert s.feed(b"data: 1\r") == [b"data: 1"]
    assert s.feed(b"\n") == []
    assert s.feed(b"\ndata: 2\n") == [b"", b"data: 2"]


def test_unterminated_last_line_is_flushed() -> None:
    assert list(iter_sse_lines([b"data: 1\ndata: 2"])) == [b"data: 1", b"data: 2"]


def test_a_line_without_end_is_bounded() -> None:
    s = SSELineSplitter(max_line=100)
    s.feed(b"x" * 100)
    with pytest.raises(SSELineTooLong):
        s.feed(b"x")


def test_async_twin() -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for c in (EVENT[:10], EVENT[10:] + b"\n", b"\n"):
            yield c

    async def collect() -> list[bytes]:
        return [line async for line in aiter_sse_lines(chunks())]

    assert asyncio.run(collect()) == [EVENT, b""]


def test_data_field() -> None:
    assert data_field(b"data: x") == b"x"
    assert data_field(b"data:x") == b"x"
    assert data_field(b"data:  x") == b" x"
    assert data_field(b": keep-alive") is None
    assert data_field(b"event: y") is None


def test_sdk_decoder_keeps_the_separators_in_the_text() -> None:
    dec = SSEDecoder()
    events = [dec.feed(line.decode()) for line in iter_sse_lines([EVENT + b"\n\n"])]
    chunk = next(e for e in events if e is not None)
    assert chunk.kind == "chunk" and chunk.chunk is not None
    assert chunk.chunk.text == "a" + SEPARATORS + "b"


# --- EventRelay: whole events relayed as they came -------------------------------------------

def test_a_read_of_whole_one_line_data_events_is_relayed_as_the_same_bytes() -> None:
    from zmlcore.reply.sse import EventRelay

    raw = b'data: {"a":1}\n\ndata: {"b":"x\xe2\x80\xa8y"}\n\n'
    relay = EventRelay()
    assert relay.feed(raw) is raw and not relay.done


def test_events_cut_across_reads_crlf_comments_and_done_are_reframed() -> None:
    from zmlcore.reply.sse import EventRelay, event_payloads

    relay = EventRelay()
    assert relay.feed(b'data: {"a"') == b""
    assert relay.feed(b':1}\n\n: keep-alive\n\nevent: x\r\ndata: {"b":2}\r\n\r\n') == b'data: {"a":1}\n\ndata: {"b":2}\n\n'
    assert relay.feed(b"data:\n\ndata: {\"c\":3}\n\ndata: [DONE]\n\ndata: {\"late\":1}\n\n") == b'data: {"c":3}\n\n'
    assert relay.done
    assert event_payloads(b'data: {"a":1}\n\ndata:{"b":2}\n\n') == [b'{"a":1}', b'{"b":2}']


def test_a_relayed_block_never_carries_done_or_an_empty_event() -> None:
    from zmlcore.reply.sse import EventRelay

    for raw in (b"data: [DONE]\n\n", b"data: \n\n", b'data: {"a":1}\n\n\n', b'data: {"a":1}\ndata: {"b":2}\n\n'):
        out = EventRelay().feed(raw)
        assert b"[DONE]" not in out and b"data: \n" not in out
        assert out.count(b"\n") == 2 * out.count(b"\n\n")  # one line per event


def test_a_whole_answer_read_at_once_is_relayed_as_the_same_bytes_up_to_its_done() -> None:
    from zmlcore.reply.sse import EventRelay

    events = b"".join(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(18))
    relay = EventRelay()
    assert relay.feed(events + b"data: [DONE]\n\n") == events and relay.done
    # [DONE] elsewhere than as the last event: read line by line, as before
    relay = EventRelay()
    assert relay.feed(b'data: {"content":"[DONE]"}\n\ndata: [DONE]\n\n') == b'data: {"content":"[DONE]"}\n\n'
    assert relay.done
    relay = EventRelay()
    assert relay.feed(b"data: [DONE]\n\ndata: {\"late\":1}\n\n") == b"" and relay.done
    relay = EventRelay()
    assert relay.feed(b'data: {"a":1}data: [DONE]\n\n') == b'data: {"a":1}data: [DONE]\n\n' and not relay.done
    # an event of spaces only is no event
    assert EventRelay().feed(b'data:   \n\ndata: {"a":1}\n\n') == b'data: {"a":1}\n\n'
