"""Garbage collection paced by time, not only by allocations, for long-running services.

After start-up, services freeze what start-up built (config, modules, tables: alive for the
whole run, so never worth scanning again) and raise the young generation's threshold, so that
the request path is not interrupted by collections (~4% of router CPU). That threshold counts
*net* allocations of container objects, and a service at steady state allocates about as many
as it frees, so it can go tens of minutes without a collection. Meanwhile reference cycles
pile up uncollected: each timed-out ``fetch`` of the saturation queue's idle pull consumer
(once a second per model per router) leaves a ``TimeoutError``/``CancelledError`` with its
traceback, frames, task and future in a cycle — the routers' RSS grew ~0.4 MiB a minute in
the soak (``benches/soak.py``) with the Python heap otherwise flat.

So a full collection also runs every ``every_s`` seconds. With start-up objects frozen the
heap it scans is small (10,000 objects: ~0.3 ms), and cycles live seconds, not tens of minutes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("zml.gc")

#: Seconds between timed full collections.
EVERY_S = 10.0


def settle() -> None:
    """Once start-up is done: collect, freeze what survived, collect young objects rarely."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


async def collect_every(every_s: float = EVERY_S) -> None:
    """Run for the life of the service: a full collection every ``every_s`` seconds."""
    while True:
        await asyncio.sleep(every_s)
        t0 = time.perf_counter()
        freed = gc.collect()
        log.debug("gc: %d objects freed in %.1f ms", freed, (time.perf_counter() - t0) * 1000)
