"""The batch runner: works through the Batch API's queue (docs/batches.md).

Any number of runners share the work stream ``ZML_BATCH_WORK``, each message going to one of
them: ``start`` (validate a new batch and cut it into shards: ``zml_batch.starter``),
``shard.<batch>`` (send its lines through the routers at batch priority, record each answer:
``zml_batch.worker``), ``final`` (write the output and error files: ``zml_batch.finalize``).
A runner that dies leaves what it held to the others; nothing it recorded is asked again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.batch import objects
from zmlcore.batch.store import TASK_ACK_WAIT_S, BatchStore
from zmlcore.config import ZMLConfig
from zmlcore.messages.batch import BatchRecord, batch_task_decoder
from zmlcore.runtime.runner import cancel_and_wait
from zml_batch import finalize, metrics, starter
from zml_batch.plans import Plans
from zml_batch.request import policy_field
from zml_batch.worker import Worker

log = logging.getLogger("zml.batch")
_encode = msgspec.json.encode


class BatchRunner:
    def __init__(self, cfg: ZMLConfig, runner_id: str | None = None) -> None:
        self.cfg = cfg
        self.runner_id = runner_id or f"batch-{os.urandom(3).hex()}"
        self.nc: NATS | None = None
        self.store: BatchStore | None = None
        self.worker: Worker | None = None
        self.plans: Plans | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def policy_of(self, rec: BatchRecord) -> bytes:
        """What a line that names no policy routes with: the batch's (metadata.policy or
        [batch] policy), else the built-in batch policy: the cheapest family within the
        relaxed latency target."""
        if rec.policy:
            return policy_field(rec.policy, None)
        return policy_field("", {"name": "batch", "strategy": "cost",
                                 "latency_target_ms": self.cfg.batch.latency_target_ms})

    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.store = await BatchStore.open(nc, self.cfg.batch, consumers=True)
        self.plans = await Plans.open(nc)
        self.worker = Worker(self.cfg, nc, self.store, runner_id=self.runner_id, policy_of=self.policy_of,
                             plans=self.plans)
        js = nc.jetstream()
        starts = await js.pull_subscribe(subjects.BATCH_WORK_START, durable=subjects.BATCH_START_CONSUMER,
                                         stream=subjects.BATCH_WORK_STREAM)
        finals = await js.pull_subscribe(subjects.BATCH_WORK_FINAL, durable=subjects.BATCH_FINAL_CONSUMER,
                                         stream=subjects.BATCH_WORK_STREAM)
        self._tasks = [
            asyncio.create_task(self.worker.run(), name="batch-lines"),
            asyncio.create_task(self.worker.upkeep(), name="batch-progress"),
            asyncio.create_task(self._tasks_of(starts, self._start_one), name="batch-starts"),
            asyncio.create_task(self._tasks_of(finals, self._final_one), name="batch-finals"),
        ]

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        await cancel_and_wait(self._tasks)
        if self.plans is not None:
            await self.plans.close()  # tokens not written yet go now

    async def _tasks_of(self, psub: Any, handle: Callable[[bytes], Awaitable[BatchRecord | None]]) -> None:
        """One task at a time from a durable consumer: handled, then acked (a crash in between
        leaves it to another runner, and every handler is idempotent)."""
        assert self.nc is not None
        while True:
            if not self.nc.is_connected:
                await asyncio.sleep(0.5)
                continue
            try:
                msgs = await psub.fetch(1, timeout=5.0)
            except asyncio.TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("fetch failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                renew = asyncio.create_task(self._renew(msg))
                try:
                    rec = await handle(msg.data)
                    await msg.ack()
                    if rec is not None:
                        await self._event(rec)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("batch task on %s failed; it will be tried again", msg.subject)
                    try:
                        await msg.nak(delay=2.0)
                    except Exception:
                        pass
                finally:
                    renew.cancel()

    @staticmethod
    async def _renew(msg: Any) -> None:
        while True:
            await asyncio.sleep(TASK_ACK_WAIT_S / 4)
            try:
                await msg.in_progress()
            except Exception:
                pass

    async def _start_one(self, data: bytes) -> BatchRecord | None:
        assert self.store is not None
        task = batch_task_decoder.decode(data)
        rec = await starter.start(self.store, task, self.cfg.batch.shard_lines)
        if rec is not None and rec.shards == 0 and rec.status == "cancelling":
            await self._final_one(data)  # cancelled before any shard was cut: written out now
        return rec

    async def _final_one(self, data: bytes) -> BatchRecord | None:
        assert self.store is not None
        rec = await finalize.finalize(self.store, batch_task_decoder.decode(data), self.cfg.batch.file_ttl_s)
        if rec is not None:
            metrics.BATCHES(rec.status).inc()
        return rec

    async def _event(self, rec: BatchRecord) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(subjects.BATCH_EVENTS, _encode(objects.event(rec, time.time())))
        except Exception:  # an event is a hint (the record is the truth)
            pass
