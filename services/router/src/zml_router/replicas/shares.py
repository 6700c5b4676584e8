"""The tenants' fair-share counters, kept in step with the other replicas (zmlcore.flowctl.shares).

Each replica charges what it dispatches to its own ShareBook and publishes its counters on
``zml.flow.shares`` (messages.flow.ShareReport) every ``[flow] share_report_ms`` when they
changed; each takes the others' reports as they come. The queue's order and the gate then see
every replica's dispatches, at most one report interval (plus the bus) late: N replicas act as
one fair scheduler (benches/flow_sim.py measures it with 4 replicas and 1-5 ms of lag).
Nothing is published by a router that serves only plain requests.

    shares = ShareSync(nc, book, interval_s=0.1)
    await shares.start()
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.messages.flow import share_report_decoder

from zmlcore.flowctl import ShareBook

log = logging.getLogger("zml.router.shares")
_encode = msgspec.json.encode


class ShareSync:
    def __init__(self, nc: NATS, book: ShareBook, interval_s: float) -> None:
        self.nc = nc
        self.book = book
        self._sent = 0  # the book's version last reported
        self.interval_s = interval_s
        self._sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(subjects.FLOW_SHARES, cb=self._on_report)
        self._task = asyncio.create_task(self._publish())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection gone
                pass

    async def _on_report(self, msg: Msg) -> None:
        try:
            report = share_report_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.book.merge(report, time.time())

    async def _publish(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.book.version == self._sent:
                continue
            self._sent = self.book.version
            try:
                await self.nc.publish(subjects.FLOW_SHARES, _encode(self.book.report(time.time())))
            except Exception:  # a lost report: the next one carries the same counters, newer
                log.debug("share report not published", exc_info=True)
