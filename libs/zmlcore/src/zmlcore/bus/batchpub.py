"""Messages published off the request path, gathered for a few milliseconds and sent together.

A statistic published per request (a router's completion event) costs more than its bytes:
nats-server wakes once per message for every subscriber (health, warmup, each gateway's
dashboard), and each of them wakes, reads and decodes it; at one request at a time that is a
send, a fan-out and a wake-up per subscriber per request (health alone: ~0.1 ms of CPU per
request, docs/benchmarks.md). Gathered for ``window_s``, the messages go out in one write,
nats-server fans them out in one write per subscriber, and each subscriber wakes once for all
of them. The wire does not change: each message is published on its own, as before.

    events = BatchPublisher(nc, "zml.events.completed", window_s=0.01)
    events.start()
    events.add(encoded)        # no await, no I/O on the caller's path
    await events.stop()        # what is pending is sent (bounded)
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from zmlcore.bus.cancel import cancel_and_wait
from zmlcore.bus.publish import Publisher, flush

log = logging.getLogger("zml.batchpub")

#: Messages held at most; past it the oldest are dropped (counted): a statistic must never grow
#: without bound while the broker is away.
MAX_PENDING = 10_000


class BatchPublisher:
    def __init__(self, nc: NATS, subject: str, window_s: float, max_pending: int = MAX_PENDING) -> None:
        self.nc = nc
        self.pub = Publisher.of(nc)
        self.subject = subject
        self.window_s = window_s
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: list[bytes] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def add(self, data: bytes) -> None:
        if len(self._pending) >= self.max_pending:
            del self._pending[0]
            self.dropped += 1
        self._pending.append(data)
        if not self._wake.is_set():
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.window_s)
            self._wake.clear()
            await self._send()

    async def _send(self) -> None:
        batch, self._pending = self._pending, []
        for data in batch:
            try:
                await self.pub.publish(self.subject, data)  # appends to the client's buffer: one write for all
            except Exception:  # losing a statistic must never fail anything
                log.debug("message on %s not published", self.subject, exc_info=True)

    async def stop(self) -> None:
        """Stop the timer and send what is pending."""
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        if self._pending and self.nc.is_connected:
            await self._send()
            try:
                await flush(self.nc, 2.0)
            except Exception:
                pass
