"""SharedLimiter's I/O half against a real nats-server: two limiters (two replicas, each with its
own connection) spending one key's plan through leases on the zml_limits bucket."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS

from nats.js.errors import KeyNotFoundError

from zmlcore import subjects
from zmlcore.limits.leases import SHARE
from zmlcore.limits.limiter import SharedLimiter, limit_key
from zmlcore.messages.keys import LimitState, PlanLimits, limit_state_decoder


@pytest.fixture
async def replicas(nats_url: str) -> AsyncIterator[tuple[SharedLimiter, SharedLimiter, NATS]]:
    conns = [await nats.connect(nats_url) for _ in range(3)]
    a, b = SharedLimiter.open(conns[0]), SharedLimiter.open(conns[1])
    la, lb = await a, await b
    try:
        yield la, lb, conns[2]
    finally:
        await la.close()
        await lb.close()
        for nc in conns:
            await nc.close()


async def _entry(nc: NATS, identity: str) -> LimitState:
    kv = await nc.jetstream().key_value(subjects.LIMITS_BUCKET)
    return limit_state_decoder.decode((await kv.get(limit_key(identity))).value)


async def _writes(nc: NATS) -> int:
    return (await nc.jetstream().stream_info("KV_" + subjects.LIMITS_BUCKET)).state.last_seq


async def _until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)


async def test_two_replicas_spend_one_plan_with_few_writes(replicas: tuple[SharedLimiter, SharedLimiter, NATS]) -> None:
    a, b, nc = replicas
    ident, rpm = f"key:test-{os.urandom(4).hex()}", 300
    limits = PlanLimits(requests_per_minute=rpm)
    seq0 = await _writes(nc)

    async def one(lim: SharedLimiter, i: int) -> bool:
        v = await lim.acquire(ident, limits, lease_id=f"r{i}", lease_s=30)
        if v.ok:
            await asyncio.sleep(0.001)
            await lim.release(ident, lease_id=f"r{i}", tokens=1)
        return v.ok

    oks = await asyncio.gather(*(one((a, b)[i % 2], i) for i in range(2 * rpm)))
    served = sum(oks)
    assert rpm - 2 * SHARE <= served <= rpm + rpm // 20, served  # one window, or a few freed at its edge
    assert await _writes(nc) - seq0 < served // 3  # leases: not a compare-and-set per request
    # Closing gives back unspent leases and writes the tokens: the entry counts what was served.
    await a.close()
    await b.close()
    s = await _entry(nc, ident)
    assert s.requests + s.prev_requests == served and s.tokens + s.prev_tokens == served
    assert s.holds == {}


async def test_concurrency_slots_move_between_replicas(replicas: tuple[SharedLimiter, SharedLimiter, NATS]) -> None:
    a, b, nc = replicas
    ident = f"key:test-{os.urandom(4).hex()}"
    limits = PlanLimits(concurrent=3)
    assert all([(await a.acquire(ident, limits, lease_id=f"a{i}", lease_s=30)).ok for i in range(3)])
    v = await b.acquire(ident, limits, lease_id="b0", lease_s=30)
    assert not v.ok and v.reason == "concurrent" and v.retry_after_s > 0
    assert (await _entry(nc, ident)).holds[a.holder].slots == 3
    await a.release(ident, lease_id="a0", tokens=0)  # near the limit: the slot goes back at once

    async def admitted() -> bool:
        return (await b.acquire(ident, limits, lease_id="b1", lease_s=30)).ok
    await _until(admitted, 5.0)
    assert not (await a.acquire(ident, limits, lease_id="a9", lease_s=30)).ok
    await a.close()  # shutdown frees a's held slots for the other replica
    s = await _entry(nc, ident)
    assert a.holder not in s.holds and s.holds[b.holder].slots == 1
    assert (await b.acquire(ident, limits, lease_id="b2", lease_s=30)).ok


async def test_a_released_slot_is_free_on_the_other_replica_when_release_returns(
        replicas: tuple[SharedLimiter, SharedLimiter, NATS]) -> None:
    """A sequential client at concurrency 1, its requests alternating between replicas: each
    release is in the shared entry before it returns (the caller replies after it), so the
    next request, on the other replica, is never refused. The old release_soon left that write to a
    background task: the next admission could still see the slot held."""
    a, b, nc = replicas
    ident = f"key:test-{os.urandom(4).hex()}"
    limits = PlanLimits(concurrent=1)
    for i in range(40):
        lim = (a, b)[i % 2]
        v = await lim.acquire(ident, limits, lease_id=f"r{i}", lease_s=30)
        assert v.ok, (i, v)
        await lim.release(ident, lease_id=f"r{i}", tokens=1)
    assert all(h.slots == 0 for h in (await _entry(nc, ident)).holds.values())


async def test_release_without_urgency_costs_no_write(replicas: tuple[SharedLimiter, SharedLimiter, NATS]) -> None:
    a, _, nc = replicas
    ident = f"key:test-{os.urandom(4).hex()}"
    limits = PlanLimits(concurrent=1000)  # slots plenty: nobody waits for this one's
    assert (await a.acquire(ident, limits, lease_id="r0", lease_s=30)).ok
    assert (await a.acquire(ident, limits, lease_id="r1", lease_s=30)).ok
    seq = await _writes(nc)
    await a.release(ident, lease_id="r0", tokens=0)
    assert await _writes(nc) == seq


async def test_batch_tokens_count_in_the_plan_and_hold_its_batches_when_spent(
        replicas: tuple[SharedLimiter, SharedLimiter, NATS]) -> None:
    """A batch runner's tokens (add_tokens) land in the same entry as the key's requests, and
    tokens_wait says when that key's batch lines may go again (zml_batch.plans)."""
    runner, gateway, nc = replicas
    ident = f"key:batch-{os.urandom(3).hex()}"
    plan = PlanLimits(requests_per_minute=600, tokens_per_minute=1000)
    tokens_only = PlanLimits(tokens_per_minute=1000)
    assert await runner.tokens_wait(ident, tokens_only) == 0.0
    await runner.add_tokens(ident, tokens_only, 400)
    assert await runner.tokens_wait(ident, tokens_only) == 0.0  # 400 of 1000: room left
    await runner.add_tokens(ident, tokens_only, 700)  # over the minute's 1000: written within a sweep

    async def written() -> int:
        try:
            return (await _entry(nc, ident)).tokens
        except KeyNotFoundError:
            return 0

    deadline = time.monotonic() + 5
    while await written() < 1100:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert await runner.tokens_wait(ident, tokens_only) > 0
    # the key's own requests see the batch's tokens: refused on tokens, from another replica
    v = await gateway.acquire(ident, plan, lease_id="r1", lease_s=10)
    assert not v.ok and v.reason == "tokens"
    assert await runner.tokens_wait(ident, PlanLimits()) == 0.0  # no token limit: never waits
