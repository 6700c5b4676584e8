"""Batch priority at the router (Zml-Priority: batch, zmlcore.policy.headroom): batch requests
take a node only while it has headroom beyond [router] batch_reserve, are refused at once
otherwise (QUEUE_FULL, no_headroom), and never keep an interactive request from a free slot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import nats
import pytest

from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects

ONE = [("mi300x-1", "amd_mi300x", [MODEL])]


@pytest.fixture(scope="module")
def one_node(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = launch_stack(own_nats, tmp_path_factory.mktemp("prio"), fleet=ONE, routers=1,
                         router="cooldown_s = 2\nbatch_reserve = 0.25\n", sim_extra="max_concurrency = 4\n")
    try:
        yield stack
    finally:
        stack.stop()


async def ask(nc: nats.NATS, *, batch: bool, max_tokens: int, rid: str) -> tuple[str | None, dict]:
    headers = {subjects.H_REQUEST_ID: rid, subjects.H_TIMEOUT_MS: "20000"}
    if batch:
        headers[subjects.H_PRIORITY] = subjects.PRIORITY_BATCH
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=25, headers=headers)
    return (msg.headers or {}).get(subjects.H_ERROR_CODE), json.loads(msg.data)


def test_batch_work_fills_headroom_only_and_interactive_still_gets_a_slot(one_node: Stack) -> None:
    async def go() -> None:
        nc = await nats.connect(one_node.nats_url)
        try:
            # 4 slots, 1 reserved: batch lines may hold 3 (~5 s each at the sim's 20x); the fourth
            # is refused.
            running = [asyncio.create_task(ask(nc, batch=True, max_tokens=5000, rid=f"b{i}")) for i in range(3)]
            await asyncio.sleep(0.5)
            code, body = await ask(nc, batch=True, max_tokens=4, rid="b-extra")
            assert code == "QUEUE_FULL", body
            assert body["error"]["routing_context"]["final_error"] == "no_headroom"
            assert body["error"]["retry_after"] <= 1
            # the reserved slot is the interactive request's, at once
            code, body = await ask(nc, batch=False, max_tokens=4, rid="interactive")
            assert code is None, body
            done = await asyncio.gather(*running)
            assert [c for c, _ in done] == [None, None, None], done
            # the node is free again: batch work goes
            code, body = await ask(nc, batch=True, max_tokens=4, rid="b-after")
            assert code is None, body
        finally:
            await nc.close()

    asyncio.run(go())
