"""zmlcore.bus.batchpub against a real nats-server: messages added on the request path arrive each
as its own message (the wire unchanged), in order, together after the window; stop() sends what
is pending; the pending list is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest

from zmlcore.bus.batchpub import BatchPublisher


@pytest.fixture()
async def nc(nats_url: str) -> AsyncIterator[Any]:
    c = await nats.connect(nats_url)
    yield c
    await c.close()


def collector() -> tuple[list[bytes], Any]:
    got: list[bytes] = []

    async def on(msg: Any) -> None:
        got.append(msg.data)
    return got, on


async def test_messages_arrive_one_by_one_in_order_after_the_window(nc: Any) -> None:
    got, on = collector()
    sub = await nc.subscribe("test.batchpub.a", cb=on)
    pub = BatchPublisher(nc, "test.batchpub.a", window_s=0.2)
    pub.start()
    try:
        for i in range(50):
            pub.add(b"%d" % i)
        await asyncio.sleep(0.05)
        assert got == []  # held for the window, not sent one by one
        for _ in range(100):
            if len(got) == 50:
                break
            await asyncio.sleep(0.05)
        assert got == [b"%d" % i for i in range(50)]
    finally:
        await pub.stop()
        await sub.unsubscribe()


async def test_stop_sends_what_is_pending_and_pending_is_bounded(nc: Any) -> None:
    got, on = collector()
    sub = await nc.subscribe("test.batchpub.b", cb=on)
    pub = BatchPublisher(nc, "test.batchpub.b", window_s=60.0, max_pending=10)
    pub.start()
    for i in range(15):
        pub.add(b"%d" % i)
    assert pub.dropped == 5
    await pub.stop()
    for _ in range(100):
        if len(got) == 10:
            break
        await asyncio.sleep(0.02)
    assert got == [b"%d" % i for i in range(5, 15)]
    await sub.unsubscribe()
