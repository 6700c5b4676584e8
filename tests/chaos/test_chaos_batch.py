"""Chaos on the Batch API: a batch running on two runners, and kill -9 of a batch runner, a
router, the gateway, the health service and the broker (one at a time, each restarted as a
supervisor would). Every `custom_id` must be in the output or error file exactly once, every
line answered (nothing lost), and lines asked of a node twice at most those in flight at the
crash (a line whose answer was recorded is never asked again).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chaosstack import FLEET, ChaosStack, NatsServer
from conftest import MODEL
from zmlcore.runtime.launch import free_port

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

LINES = 240
#: Lines per runner in flight at most, and so the most a runner's crash can make ask twice.
IN_FLIGHT = 24
BATCH_TOML = f"""
[batch]
takeover_s = 4
shard_lines = 20
max_in_flight = {IN_FLIGHT}
"""


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ChaosStack, NatsServer]]:
    tmp = tmp_path_factory.mktemp("chaos-batch")
    server = NatsServer("nats", free_port(), tmp / "store")
    server.start()
    stack = ChaosStack(tmp, [server.url], routers=2, gateways=1, health=1, batch=2, time_scale=5.0,
                       extra_toml=BATCH_TOML, sim_extra="max_concurrency = 6\n")
    try:
        stack.start()
        yield stack, server
    finally:
        stack.stop()
        server.stop()


def served(stack: ChaosStack) -> int:
    """Requests the sims have answered in all (successes), to count work done twice."""
    total = 0
    for node_id, _, _ in FLEET:
        for stats in stack.sim_state(node_id)["counters"].values():
            total += sum(stats["success"].values())
    return total


def submit(client: openai.OpenAI, tag: str) -> str:
    rows = "\n".join(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": MODEL, "messages": [{"role": "user", "content": f"{tag} {i}"}],
                                          "max_tokens": 60}}) for i in range(LINES))
    f = client.files.create(file=(f"{tag}.jsonl", io.BytesIO(rows.encode())), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def retrieve(client: openai.OpenAI, batch_id: str) -> Any:
    """The batch, asking again while the gateway or the broker is away."""
    for _ in range(200):
        try:
            return client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            time.sleep(0.25)
    raise AssertionError("the gateway never answered again")


def run_with_fault(stack: ChaosStack, server: NatsServer, tag: str, fault: str) -> dict[str, Any]:
    client = openai.OpenAI(base_url=stack.gateway_urls[0] + "/v1", api_key="none", max_retries=0, timeout=10)
    before = served(stack)
    batch_id = submit(client, tag)
    t0 = time.monotonic()
    while retrieve(client, batch_id).request_counts.completed < LINES // 4:
        assert time.monotonic() - t0 < 120, "the batch did not get going"
        time.sleep(0.1)
    at_fault = retrieve(client, batch_id).request_counts.completed
    if fault == "broker":
        server.kill()
        time.sleep(1.0)
        server.start()
    else:
        stack.kill(fault)
        time.sleep(1.0)
        stack.restart(fault)
    deadline = time.monotonic() + 300
    while (b := retrieve(client, batch_id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"{fault}: batch still {b.status} {b.request_counts}"
        time.sleep(0.3)
    rows: list[dict[str, Any]] = []
    for fid in (b.output_file_id, b.error_file_id):
        if fid:
            rows += [json.loads(x) for x in client.files.content(fid).text.splitlines() if x.strip()]
    ids = [r["custom_id"] for r in rows]
    ok = [r for r in rows if r["response"] and r["response"]["status_code"] == 200]
    extra = served(stack) - before - len(ok)
    out = {"fault": fault, "status": b.status, "rows": len(rows), "distinct": len(set(ids)), "completed": len(ok),
           "completed_at_fault": at_fault, "asked_twice": extra, "seconds": round(time.monotonic() - t0, 1)}
    print(f"chaos batch {json.dumps(out)}")
    assert b.status == "completed", out
    assert sorted(ids) == sorted(f"{tag}-{i}" for i in range(LINES)), "every custom_id exactly once"
    assert len(ok) == LINES, out  # nothing lost: every line answered in the end
    return out


@pytest.mark.parametrize("fault", ["batch-1", "router-1", "gateway-1", "health-1", "broker"])
def test_kill_9_mid_batch_loses_and_duplicates_nothing(chaos: tuple[ChaosStack, NatsServer], fault: str) -> None:
    stack, server = chaos
    out = run_with_fault(stack, server, fault.replace("-", ""), fault)
    # Work asked of a node twice: only lines in flight at the crash (a killed runner's, or
    # replies lost with a router or the broker), never a line whose answer was recorded.
    assert out["asked_twice"] <= 2 * IN_FLIGHT, out
    if fault in ("gateway-1", "health-1"):  # not on the lines' path (health: routers keep their state)
        assert out["asked_twice"] == 0, out
