"""The saturation queue never dispatches one entry twice (issue 8 item 6), on a real broker.

Two SaturationQueue instances play two router replicas. The first takes the head, dispatches
it and dies before acknowledging it (its connection is closed: JetStream redelivers the head
after ack_wait). The second must not dispatch it again.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from zmlcore import subjects
from zml_router.incoming import QueuedMsg
from zml_router.queue.jetstream import ACK_WAIT_S, SaturationQueue

MODEL = "claims/model"


async def _wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


class Replica:
    """The router's side of the queue, reduced to what the test watches."""

    def __init__(self, name: str, *, hang: bool = False, refuse_first: int = 0, room: bool = True) -> None:
        self.name = name
        self.hang = hang
        self.refuse = refuse_first
        self.room = room
        self.dispatched: list[bytes] = []
        self.expired: list[bytes] = []

    def has_room(self, qmsg: QueuedMsg) -> bool:
        return self.room

    async def dispatch(self, qmsg: QueuedMsg, deadline: float) -> bool:
        self.dispatched.append(qmsg.data)
        if self.hang:  # running on a node when the replica dies: never answers, never acks
            await asyncio.Event().wait()
        if self.refuse:
            self.refuse -= 1
            return False  # the node refused it at once: the holder keeps it
        return True

    async def expire(self, qmsg: QueuedMsg, enqueued_at: float) -> None:
        self.expired.append(qmsg.data)  # would answer QUEUE_FULL to the caller

    async def start(self, url: str, models: tuple[str, ...] = (MODEL,)) -> tuple[nats.NATS, SaturationQueue]:
        nc = await nats.connect(url)
        q = SaturationQueue(nc, self.has_room, self.dispatch, self.expire, lambda rid: False, owner=self.name)
        await q.start(list(models))
        return nc, q


async def _queued_count(nc: nats.NATS) -> int:
    info = await nc.jetstream().stream_info(subjects.QUEUE_STREAM)
    return info.state.messages


@pytest.mark.parametrize("room", [True, False], ids=["room", "no-room"])
async def test_a_replica_dying_after_dispatch_does_not_get_its_entry_dispatched_again(own_nats: str, room: bool) -> None:
    a = Replica("router-a", hang=True)
    nc_a, q_a = await a.start(own_nats)
    # Without room the entry would expire while B holds it: that answer (QUEUE_FULL) must not
    # reach a caller that may be reading the answer of the dispatch that did happen.
    deadline = time.time() + (60 if room else ACK_WAIT_S + 2)
    await q_a.enqueue(MODEL, b'{"n": 1}', "_INBOX.x", {subjects.H_REQUEST_ID: "r1"}, deadline)
    assert await _wait(lambda: a.dispatched, 5), "replica A never took the head"
    # A dies holding the dispatched head, unacknowledged.
    await q_a.stop()
    await nc_a.close()

    b = Replica("router-b", room=room)
    nc_b, q_b = await b.start(own_nats)
    try:
        # JetStream redelivers the head to B after ack_wait; B sees the claim and drops it: acked,
        # the stream is empty (waited for, not slept past). Without room, on past the entry's
        # deadline too, where a held copy would have expired.
        until = time.monotonic() + ACK_WAIT_S + 4
        while await _queued_count(nc_b) and time.monotonic() < until:
            await asyncio.sleep(0.1)
        if not room:
            await asyncio.sleep(max(0.0, deadline + 1 - time.time()))
        assert b.dispatched == [], "the entry ran twice"
        assert b.expired == [], "a second answer (QUEUE_FULL) for an entry that ran"
        assert await _queued_count(nc_b) == 0  # dropped (acked), not stuck at the head
        b.room = True
        # B does dispatch what nobody has claimed.
        await q_b.enqueue(MODEL, b'{"n": 2}', "_INBOX.y", {subjects.H_REQUEST_ID: "r2"}, time.time() + 60)
        assert await _wait(lambda: b.dispatched == [b'{"n": 2}'], 5), b.dispatched
    finally:
        await q_b.stop()
        await nc_b.close()


async def test_an_entry_refused_at_once_is_dispatched_again_by_its_holder(own_nats: str) -> None:
    r = Replica("router-c", refuse_first=2)
    nc, q = await r.start(own_nats)
    try:
        await q.enqueue(MODEL, b'{"n": 3}', "_INBOX.z", {subjects.H_REQUEST_ID: "r3"}, time.time() + 60)
        assert await _wait(lambda: len(r.dispatched) == 3, 10), r.dispatched
        await asyncio.sleep(0.5)
        assert r.dispatched == [b'{"n": 3}'] * 3  # refused twice, placed on the third try
        deadline = time.monotonic() + 5
        while await _queued_count(nc) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await _queued_count(nc) == 0
    finally:
        await q.stop()
        await nc.close()


async def test_an_entry_handed_on_from_a_stalled_holder_is_left_to_its_claimer(own_nats: str) -> None:
    # A holder whose heartbeat stops past ACK_WAIT_S (a stalled event loop) while it dispatches
    # an entry: JetStream hands the entry to B, which finds A's claim. A announced itself within
    # BUSY_TTL_S, so B neither dispatches it nor acks it (acked, it would be gone from the stream
    # while A may still need it back, e.g. refused by the node); A's own ack ends it.
    model = "claims/stall"
    release = asyncio.Event()

    class Stalled(Replica):
        async def dispatch(self, qmsg: QueuedMsg, deadline: float) -> bool:
            self.dispatched.append(qmsg.data)
            await release.wait()
            return True

    a, b = Stalled("router-s"), Replica("router-t")
    nc_b, q_b = await b.start(own_nats, models=())  # hears A's announcements; polls nothing yet
    nc_a, q_a = await a.start(own_nats, models=(model,))
    q_a.keepalive_s = 60.0  # A's heartbeat stalls
    js = nc_b.jetstream()
    consumer = subjects.queue_consumer(subjects.queue_key(model))
    try:
        await q_a.enqueue(model, b'{"n": 4}', "_INBOX.s", {subjects.H_REQUEST_ID: "r4"}, time.time() + 60)
        assert await _wait(lambda: a.dispatched, 5), "A never took it"
        q_b._ensure_worker_key(subjects.queue_key(model))  # now B polls the model's queue too
        await asyncio.sleep(ACK_WAIT_S + 0.3)  # handed to B meanwhile (A sent no in_progress)
        assert (await js.consumer_info(subjects.QUEUE_STREAM, consumer)).num_redelivered == 1
        assert b.dispatched == [] and await _queued_count(nc_b) == 1  # left to A, still in the stream
        release.set()
        deadline = time.monotonic() + 5
        while await _queued_count(nc_b) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await _queued_count(nc_b) == 0 and b.dispatched == []  # A's ack ended it, once
    finally:
        release.set()
        for q, nc in ((q_a, nc_a), (q_b, nc_b)):
            await q.stop()
            await nc.close()
