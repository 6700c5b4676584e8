"""zmlcore.exchange.Sink: one timer kept across waits that messages end (no timer per
stream chunk), and still no wait longer than asked."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from zmlcore.exchange import Sink


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
