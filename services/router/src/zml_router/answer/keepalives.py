"""The router's one keepalive task: walks the requests that asked for keepalives
(zmlcore.reply.keepalive.KeepaliveBook) and sends one on each reply subject silent for its interval.
One task for all requests, not a timer each. After a second with no such request in flight it
parks until one arrives: an idle router woke 20 times a second for nothing. Under load it does
not park (the book is rarely empty for a whole second), so a request does not pay a wake-up."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client as NATS

from zmlcore.reply.keepalive import MIN_INTERVAL_MS, KeepaliveBook, keepalive_headers
from zmlcore.bus.publish import Publisher

log = logging.getLogger("zml.router")

#: Half the shortest interval a request may ask for: a keepalive is at most this late.
TICK_S = MIN_INTERVAL_MS / 2000.0
#: Ticks with an empty book before the task parks.
PARK_AFTER = 20


async def send_keepalives(book: KeepaliveBook, nc: NATS) -> None:
    headers = keepalive_headers()
    pub = Publisher.of(nc)
    woken = asyncio.Event()
    empty = 0
    while True:
        await asyncio.sleep(TICK_S)
        if not book:
            empty += 1
            if empty >= PARK_AFTER:
                woken.clear()
                book.on_first = woken.set  # the first keepalive is due an interval (2 ticks or more) later
                try:
                    await woken.wait()
                finally:
                    book.on_first = None
                empty = 0
            continue
        empty = 0
        if not nc.is_connected:
            continue
        for reply in book.due(time.monotonic()):
            try:
                await pub.publish(reply, b"", headers=headers)
            except Exception:  # connection closing: the requester's own watch decides
                log.debug("keepalive not sent", exc_info=True)
                break
