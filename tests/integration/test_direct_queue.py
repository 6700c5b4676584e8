"""zmlcore.bus.direct with a queue group, against a real nats-server (the router takes its
requests so: zml_router.service): each message reaches one member of the group, in order
within a member, and a header block comes parsed as nats-py parses it
(zmlcore.bus.natsinternals.parse_header_lines, installed by zmlcore.bus.connect)."""

from __future__ import annotations

import asyncio
from typing import Any

from zmlcore.bus.connect import connect
from zmlcore.bus.direct import subscribe_direct


async def test_a_queue_group_of_direct_subscriptions_takes_each_message_once(nats_url: str) -> None:
    a, b, pub = [await connect(nats_url, f"direct-{n}") for n in "abp"]
    got: dict[str, list[Any]] = {"a": [], "b": []}
    try:
        await subscribe_direct(a, "test.direct.q", got["a"].append, queue="routers")
        await subscribe_direct(b, "test.direct.q", got["b"].append, queue="routers")
        await a.flush()
        await b.flush()
        for i in range(200):
            await pub.publish("test.direct.q", b"%d" % i, headers={"Zml-Request-Id": f"r{i}", "Zml-Body": "clean"})
        await pub.flush()
        for _ in range(100):
            if len(got["a"]) + len(got["b"]) >= 200:
                break
            await asyncio.sleep(0.05)
        seen = [int(m.data) for m in got["a"]] + [int(m.data) for m in got["b"]]
        assert sorted(seen) == list(range(200))  # each once, none lost
        assert got["a"] and got["b"]  # shared across the group
        for member in got.values():
            assert [int(m.data) for m in member] == sorted(int(m.data) for m in member)  # in order
            assert all(m.headers == {"Zml-Request-Id": f"r{int(m.data)}", "Zml-Body": "clean"} for m in member)
    finally:
        for c in (a, b, pub):
            await c.close()
