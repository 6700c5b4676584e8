"""The leader lease (zmlcore.runtime.lease) on a real nats-server: one holder at a time, a standby takes
over within ttl + ttl/4 of the holder's last renewal, at once on a clean release, and the old
holder learns it lost the lease."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from test_health_helpers import eventually, private_nats
from zmlcore import subjects
from zmlcore.runtime.lease import Lease, lease_ttl_s
from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure_kv


@pytest.fixture(scope="module")
def nats_url() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


@pytest.fixture()
async def clients(nats_url: str) -> AsyncIterator[list]:  # type: ignore[type-arg]
    ncs = [await connect(nats_url, f"lease-{i}") for i in range(3)]
    kv = await ensure_kv(ncs[0].jetstream(), subjects.LEASES_BUCKET)
    try:
        await kv.purge("test-role")
    except Exception:
        pass
    try:
        yield ncs
    finally:
        for nc in ncs:
            await nc.close()


def test_ttl_follows_the_interval_with_a_floor() -> None:
    assert lease_ttl_s(5.0) == 5.0 and lease_ttl_s(0.1) == 2.0


async def test_one_holder_and_takeover_after_silence(clients) -> None:  # type: ignore[no-untyped-def]
    ttl = 2.0
    a, b, c = (Lease(nc, "test-role", ttl_s=ttl, holder=f"r{i}") for i, nc in enumerate(clients))
    await asyncio.wait_for(a.acquire(), 5)
    holding = asyncio.create_task(a.hold())
    waiting = [asyncio.create_task(b.acquire()), asyncio.create_task(c.acquire())]
    await asyncio.sleep(2 * ttl)  # renewed all along: nobody takes over
    assert not any(t.done() for t in waiting) and not holding.done()

    holding.cancel()  # the holder freezes (as if killed -9): no more renewals
    silent_at = time.monotonic()
    done, pending = await asyncio.wait(waiting, timeout=4 * ttl, return_when=asyncio.FIRST_COMPLETED)
    took = time.monotonic() - silent_at
    assert len(done) == 1, "exactly one standby takes over"
    assert 0.6 * ttl <= took <= 2 * ttl, took  # ttl after the last renewal (up to ttl/3 before the freeze), never two late
    winner = b if waiting[0] in done else c
    winner_hold = asyncio.create_task(winner.hold())
    await asyncio.sleep(1.5 * ttl)
    assert all(not t.done() for t in pending)  # the winner renews; the other keeps waiting
    loser_task = pending.pop()
    # The old holder wakes up: its next renewal fails, it has lost the lease.
    await asyncio.wait_for(a.hold(), 2 * ttl)
    assert a.revision is None

    # A clean stop hands over at once.
    winner_hold.cancel()
    released = time.monotonic()
    await winner.release()
    await asyncio.wait_for(loser_task, ttl)
    assert time.monotonic() - released < 0.6 * ttl  # at once, not after a TTL


async def test_holder_keeps_the_lease_across_a_broker_blink(clients) -> None:  # type: ignore[no-untyped-def]
    """A standby that cannot read the key does not count silence: a broker outage alone never
    moves the lease (here: the standby's own connection blinks)."""
    a, b = Lease(clients[0], "test-role", ttl_s=2.0, holder="a"), Lease(clients[1], "test-role", ttl_s=2.0, holder="b")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    standby = asyncio.create_task(b.acquire())
    await asyncio.sleep(0.5)
    await clients[1].force_reconnect()
    await eventually(lambda: clients[1].is_connected, what="standby reconnected")
    await asyncio.sleep(3.0)
    assert not standby.done() and not holding.done()
    standby.cancel()
    holding.cancel()
    await a.release()


async def test_a_late_renewal_of_its_own_does_not_lose_the_holder_its_lease(clients) -> None:  # type: ignore[no-untyped-def]
    """A renewal that timed out while the broker was away can land once the client reconnects
    (it sends what it buffered), moving the revision under the holder: the key still names the
    holder, so it keeps the lease (it used to exit as if taken over: a restart after every broker
    blink). A key naming another replica is a loss as before."""
    ttl = 2.0
    a = Lease(clients[0], "test-role", ttl_s=ttl, holder="a")
    await a.acquire()
    holding = asyncio.create_task(a.hold())
    kv = await ensure_kv(clients[1].jetstream(), subjects.LEASES_BUCKET)
    await kv.put("test-role", b"a")  # the late write of its own
    await asyncio.sleep(1.5 * ttl)  # renewals meanwhile
    assert not holding.done() and a.revision is not None
    await kv.put("test-role", b"someone-else")
    await asyncio.wait_for(holding, 2 * ttl)
    assert a.revision is None
