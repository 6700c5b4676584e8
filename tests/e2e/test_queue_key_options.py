"""A request that waits in the saturation queue keeps its API key's options (issue 9): the
default policy and cost label the gateway set (Zml-Default-Policy, Zml-Label) reach the router
that serves it from the queue. Real JetStream queue on a real broker."""

from __future__ import annotations

import asyncio
import time

import nats

from zml_router.incoming import QueuedMsg
from zml_router.queue.jetstream import SaturationQueue
from zmlcore import subjects


async def test_queued_request_keeps_default_policy_and_label(own_nats: str) -> None:
    nc = await nats.connect(own_nats)
    served: asyncio.Future[QueuedMsg] = asyncio.get_running_loop().create_future()

    async def dispatch(qmsg: QueuedMsg, deadline: float) -> bool:
        if not served.done():
            served.set_result(qmsg)
        return True

    async def expire(qmsg: QueuedMsg, enqueued_at: float) -> None:
        pass

    queue = SaturationQueue(nc, lambda q: True, dispatch, expire, lambda q: False, owner="test")
    try:
        await queue.start([])
        await queue.enqueue("labelled-model", b'{"model": "labelled-model"}', "_INBOX.reply",
                            {subjects.H_REQUEST_ID: "r-1", subjects.H_TIMEOUT_MS: "30000",
                             subjects.H_DEFAULT_POLICY: "cost", subjects.H_LABEL: "billing",
                             subjects.H_OWNER: "key:abc", "Not-Kept": "x"}, time.time() + 30)
        qmsg = await asyncio.wait_for(served, 20)
    finally:
        await queue.stop()
        await nc.close()
    assert qmsg.reply == "_INBOX.reply"
    assert qmsg.headers[subjects.H_DEFAULT_POLICY] == "cost"
    assert qmsg.headers[subjects.H_LABEL] == "billing"
    assert qmsg.headers[subjects.H_OWNER] == "key:abc"
    assert "Not-Kept" not in qmsg.headers
