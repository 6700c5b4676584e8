"""The tenants' fair-share counters kept in step between router replicas over a real
nats-server (zml_router.replicas.shares): what one replica charges, the others count, so N
replicas order their queues by the same shares."""

from __future__ import annotations

import asyncio
import time

import pytest

from test_health_helpers import connected, eventually, private_nats
from zml_router.replicas.shares import ShareSync
from zmlcore.flowctl import ShareBook


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


async def test_replicas_count_each_others_charges(nats_private: str) -> None:
    async with connected(nats_private) as nc_a, connected(nats_private) as nc_b:
        a, b = ShareBook("router-a", half_life_s=30.0), ShareBook("router-b", half_life_s=30.0)
        sa, sb = ShareSync(nc_a, a, 0.02), ShareSync(nc_b, b, 0.02)
        await sa.start()
        await sb.start()
        try:
            now = time.time()
            a.charge("key:flood", 10_000.0, now)
            b.charge("key:steady", 500.0, now)
            await eventually(lambda: b.tokens("key:flood", time.time()) > 9_000
                             and a.tokens("key:steady", time.time()) > 450, 5.0)
            # both see the same picture: the flood over its share, the steady tenant under it
            for book in (a, b):
                t = time.time()
                assert book.share_used("key:flood", 1.0, t) > 1.8
                assert book.share_used("key:steady", 1.0, t) < 0.2
            # nothing new charged: nothing more published
            sent = sa._sent
            await asyncio.sleep(0.1)
            assert sa._sent == sent
        finally:
            await sa.stop()
            await sb.stop()
