"""zmlcore.reply.exchange.Sink: one timer kept across waits that messages end (no timer per
stream chunk), and still no wait longer than asked; zmlcore.reply.streamframe's decode and collect."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from zmlcore.reply.exchange import Sink


async def test_a_wait_ends_at_its_deadline_even_when_a_later_timer_is_armed() -> None:
    sink = Sink(8)
    waiting = asyncio.ensure_future(sink.wait(30.0))  # arms a timer 30 s out
    await asyncio.sleep(0.01)
    sink.push(SimpleNamespace(data=b"x", headers=None))  # type: ignore[arg-type]
    await asyncio.wait_for(waiting, 5)
    assert sink.pop() is not None
    t = time.monotonic()
    await asyncio.wait_for(sink.wait(0.05), 5)  # the 30 s timer must not stand in for this one
    assert time.monotonic() - t < 2.0
    sink.close()


async def test_the_timer_of_a_wait_a_message_ended_is_kept_and_ends_the_next_wait() -> None:
    sink = Sink(8)
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(sink.wait(0.2))
    await asyncio.sleep(0.01)
    sink.push(SimpleNamespace(data=b"x", headers=None))  # type: ignore[arg-type]
    await waiting
    sink.pop()
    armed = sink._timer
    assert armed is not None  # kept, not cancelled and made again per message
    t = loop.time()
    await asyncio.wait_for(sink.wait(10.0), 5)  # woken early by the kept timer: the caller re-waits
    assert loop.time() - t < 2.0
    sink.close()
    assert sink._timer is None


async def test_close_cancels_the_armed_timer() -> None:
    sink = Sink(8)
    waiting = asyncio.ensure_future(sink.wait(30.0))
    await asyncio.sleep(0.01)
    sink.push(SimpleNamespace(data=b"x", headers=None))  # type: ignore[arg-type]
    await waiting
    timer = sink._timer
    sink.close()
    assert timer is not None and timer.cancelled()


def test_collect_takes_waiting_frames_up_to_a_bound() -> None:
    from zmlcore.reply import streamframe
    from zmlcore.reply.streamseq import SeqCheck

    check = SeqCheck()
    check.gap("0")
    event = b"data: " + b"x" * 1000 + b"\n\n"
    waiting = [SimpleNamespace(data=streamframe.encode(i, event)) for i in range(2, 200)]
    it = iter(waiting)
    body, err = streamframe.collect(streamframe.encode(1, event), lambda: next(it, None), check)
    assert err is None
    n = body.count(b"data: ")
    assert body == event * n and streamframe.MAX_COLLECT_BYTES <= len(body) < streamframe.MAX_COLLECT_BYTES + len(event)
    total = n
    while (first := next(it, None)) is not None:  # the rest, in order (the check sees every number)
        body, err = streamframe.collect(first.data, lambda: next(it, None), check)
        assert err is None and len(body) < streamframe.MAX_COLLECT_BYTES + len(event)
        total += body.count(b"data: ")
    assert total == 199


@pytest.mark.parametrize("bad", [b"", b"\n", b"1", b"1\n", b"01x\ndata: a", b"1\r\ndata: a", b" 1\ndata: a",
                                 b"1\n data: a", b"\xff\ndata: a", b"9" * 13 + b"\ndata: a"])
def test_decode_rejects_what_is_not_a_frame(bad: bytes) -> None:
    from zmlcore.reply import streamframe

    with pytest.raises(streamframe.FrameError):
        streamframe.decode(bad)


def test_a_garbled_frame_after_good_ones_returns_them_with_the_error() -> None:
    from zmlcore.reply import streamframe
    from zmlcore.reply.streamseq import SeqCheck

    check = SeqCheck()
    check.gap("0")
    it = iter([SimpleNamespace(data=b"2\ndata: b\n\n"), SimpleNamespace(data=b"garbage")])
    body, err = streamframe.collect(b"1\ndata: a\n\n", lambda: next(it, None), check)
    assert body == b"data: a\n\ndata: b\n\n" and err is not None and err.code == "BACKEND_ERROR"
