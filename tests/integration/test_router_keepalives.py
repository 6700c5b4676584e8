"""The router's keepalive task against a real nats-server: with no request asking for keepalives
it parks instead of waking every tick, and a request that arrives while it is parked still gets
its keepalives on time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from zml_router.answer.keepalives import PARK_AFTER, TICK_S, send_keepalives
from zmlcore.reply.keepalive import KeepaliveBook
from zmlcore.bus.publish import flush


class CountingBook(KeepaliveBook):
    """Counts how often the task looks at the book (each look is a wake-up of the task)."""

    __slots__ = ("looks",)

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def __len__(self) -> int:
        self.looks += 1
        return super().__len__()


@pytest.fixture()
async def nc(nats_url: str) -> AsyncIterator[Any]:
    c = await nats.connect(nats_url)
    yield c
    await c.close()


async def test_idle_task_parks_and_a_new_request_still_gets_keepalives(nc: Any) -> None:
    book = CountingBook()
    task = asyncio.create_task(send_keepalives(book, nc))
    try:
        await asyncio.sleep((PARK_AFTER + 4) * TICK_S)  # empty for longer than PARK_AFTER ticks
        looks = book.looks
        await asyncio.sleep(1.0)
        assert book.looks - looks <= 1, "an idle keepalive task kept waking up"  # it woke 20 times a second

        got: list[float] = []

        async def on(msg: Any) -> None:
            got.append(time.monotonic())
        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on)
        await flush(nc)
        t0 = time.monotonic()
        book.add(inbox, 0.1, t0)
        await asyncio.sleep(0.5)
        assert len(got) >= 3, got  # every 0.1 s (at most a tick late), though the task was parked
        assert got[0] - t0 < 0.1 + 2 * TICK_S
        book.remove(inbox)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
