"""Flow control across a router's death (issue 30): a router killed while it holds queued
``critical`` requests loses none and serves none twice, and they still leave the queue before
the ``standard`` ones the surviving router holds: JetStream hands a dead holder's entries on
within ``ACK_WAIT_S`` (1 s) of its last ``in_progress``, and until then the survivor leaves
freed slots to the band the dead router announced (zml_router.queue.jetstream). Scenario:
flowkill.py; benches/flow_chaos.py repeats it and prints the timings.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

import flowkill
import flowstack
from conftest import Stack
from zmlcore.flowctl.bands import CRITICAL

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = flowstack.launch(own_nats, tmp_path_factory.mktemp("flowkill"))
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("prefer", flowstack.ROUTERS)
def test_a_router_killed_holding_critical_requests_keeps_band_order(stack: Stack, prefer: str) -> None:
    run = asyncio.run(flowkill.one_run(stack, f"{os.getpid()}-{prefer}", prefer))
    try:
        assert run.bands.get(run.victim) == CRITICAL, f"the victim held no critical entry: {run.summary()}"
        assert all(q.answers == 1 and not q.errors for q in run.queued), run.summary()  # none lost, none twice
        assert all(q.left is not None for q in run.queued), run.summary()  # every one went through the queue
        assert run.inversions() == [], run.summary()
    finally:
        flowkill.restart(stack, run.victim)
