"""Running one chaos scenario: load from 8 clients, a fault injected once the load is going,
the report, and waiting for the stack to be calm again before the next scenario."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from chaosload import Load, LoadGen, Report
from chaosstack import ChaosStack, nats_connect, poll_until
from conftest import MODEL

#: Every request's own timeout (timeout_ms) and the grace after which it counts as a hang.
TIMEOUT_S = 6.0
GRACE_S = 10.0  # generous: the CI box is 2 cores shared by many


def load_for(stack: ChaosStack, **kw: Any) -> Load:
    kw.setdefault("extra", {"policy": "round_robin"})  # every node gets its share, faulty or not
    return Load(stack.gateway_urls, MODEL, timeout_s=TIMEOUT_S, grace_s=GRACE_S, **kw)


async def run(stack: ChaosStack, name: str, inject: Callable[[], Awaitable[Any]] | None = None, *,
              total: int = 160, fault_at: int = 40, clients: int = 8, max_s: float = 90.0,
              after_fault_s: float | None = None, load: Load | None = None,
              report: Report | None = None) -> Report:
    """``total`` requests from ``clients`` workers (at most ``max_s`` seconds); ``inject`` runs
    once ``fault_at`` requests have finished (or a third of ``max_s`` has passed, on a slow
    box). With ``after_fault_s`` the load runs that long after the fault, however many requests
    that takes. ``report.notes['fault_t']`` is when the fault was injected."""
    report = report or Report(name)
    reached = asyncio.Event()

    def progress(n: int) -> None:
        if n >= fault_at:
            reached.set()

    async with LoadGen(load or load_for(stack)) as lg:
        task = asyncio.create_task(lg.closed(report, clients=clients, total=None if after_fault_s else total,
                                             duration_s=max_s, on_progress=progress))
        if inject is not None:
            try:
                await asyncio.wait_for(reached.wait(), max_s / 3)
            except asyncio.TimeoutError:
                pass
            report.notes["fault_t"] = time.monotonic()
            report.notes["in_flight_at_fault"] = lg.in_flight
            await inject()
            if after_fault_s is not None:
                await asyncio.sleep(after_fault_s)
                lg.stop()
        await task
    return report


async def calm(stack: ChaosStack, timeout: float = 60.0) -> None:
    """Wait until every router answers and sees every node up, not cooling, not saturated."""
    routers = [n for n in stack.procs if n.startswith("router")]
    nc = await nats_connect(stack.nats_urls)
    try:
        last: Any = None

        async def ok() -> bool:
            nonlocal last
            states = await stack.router_states(nc)
            last = states
            if set(states) != set(routers):
                return False
            return all(n["status"] == "up" and n["cooldown_s"] == 0 and n["saturated_s"] == 0
                       and n["effective_outstanding"] == 0
                       for s in states.values() for n in s["nodes"].values())

        if not await poll_until(ok, timeout, every=0.3):
            stack.dump(15)
            raise AssertionError(f"stack not calm after {timeout:g} s: {last}")
    finally:
        await nc.close()


async def to_thread(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kw)
