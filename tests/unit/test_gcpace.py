"""Collections paced by time: with the services' high young-generation threshold, reference
cycles made at a steady trickle (as each timed-out queue fetch makes) are freed within the
period instead of piling up for tens of minutes (the routers' RSS growth in the soak)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from zmlcore.runtime import gcpace


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture()
def service_gc() -> Iterator[None]:
    before = gc.get_threshold()
    gcpace.settle()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _trickle(n: int) -> list[weakref.ref[Node]]:
    return [weakref.ref(Node()) for _ in range(n)]


async def test_cycles_outlive_the_allocation_threshold_without_timed_collections(service_gc: None) -> None:
    refs = _trickle(200)
    await asyncio.sleep(0.2)
    assert sum(r() is not None for r in refs) == 200  # what the soak saw: nothing collects them


async def test_timed_collections_free_cycles_within_the_period(service_gc: None) -> None:
    task = asyncio.ensure_future(gcpace.collect_every(0.05))
    try:
        refs = _trickle(200)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if all(r() is None for r in refs):
                break
        assert all(r() is None for r in refs)
    finally:
        task.cancel()
