"""The saturation queue survives a broker restart (issue 8 item 2): after nats-server is killed
with -9 and comes back, here even without its store (stream and durable consumer gone), the
queue re-creates both and serves new entries again."""

from __future__ import annotations

import asyncio
import tempfile
import time

from test_kvfollow import Broker, retry
from test_queue_claims import MODEL, Replica
from zmlcore import subjects
from zmlcore.bus.connect import connect
from zml_router.queue.jetstream import SaturationQueue


async def _wait(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def test_queue_serves_again_after_the_broker_lost_its_store() -> None:
    with tempfile.TemporaryDirectory(prefix="zml-q-nats-") as store, \
            tempfile.TemporaryDirectory(prefix="zml-q-empty-") as empty:
        broker = Broker(store)
        broker.start()
        nc = await connect(broker.url, "router-q")
        r = Replica("router-q")
        q = SaturationQueue(nc, r.has_room, r.dispatch, r.expire, lambda rid: False, owner=r.name)
        try:
            await q.start([MODEL])
            await q.enqueue(MODEL, b'{"n": 1}', "_INBOX.x", {subjects.H_REQUEST_ID: "r1"}, time.time() + 60)
            assert await _wait(lambda: r.dispatched == [b'{"n": 1}'], 10), r.dispatched

            broker.kill()
            broker.start(empty)  # same port, no store: the stream and its consumer are gone
            back = time.monotonic()
            await retry(lambda: q.enqueue(MODEL, b'{"n": 2}', "_INBOX.x", {subjects.H_REQUEST_ID: "r2"},
                                          time.time() + 60), timeout=15)
            queued = time.monotonic() - back
            assert await _wait(lambda: b'{"n": 2}' in r.dispatched, 10), r.dispatched
            print(f"\nqueue: enqueue accepted {queued:.2f} s, dispatched {time.monotonic() - back:.2f} s after the broker came back")
        finally:
            await q.stop()
            await nc.close()
            broker.stop()
