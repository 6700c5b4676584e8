"""Issue 10 item 3 on a real engine: health polls must not wake llama-server sleeping after
``--sleep-idle-seconds`` (``/slots`` did: every poll reloaded the model); the fleet shows the
node as sleeping, and a request wakes it."""

from __future__ import annotations

import time

import httpx
import pytest

from enginefleet import SLEEP_IDLE_S, EngineFleet, engine_fleet, llama  # noqa: F401

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def is_sleeping(fleet: EngineFleet) -> bool:
    return bool(httpx.get(fleet.real["llama-sleepy"].url + "/props", timeout=5).json()["is_sleeping"])


def test_health_polls_leave_a_sleeping_llama_server_asleep(engine_fleet: EngineFleet) -> None:
    node = engine_fleet.real["llama-sleepy"]
    assert node.proc is not None
    st = engine_fleet.wait_node("llama-sleepy", lambda n: n.get("sleeping"), timeout=30, what="sleeping")
    assert st["status"] == "up"  # asleep is not down: a request wakes it
    woken = sum("exiting sleeping state" in line for line in node.proc.lines)
    polls = st["poll_interval_s"]
    time.sleep(max(4 * polls, SLEEP_IDLE_S))  # several health polls (every 0.5 s here)
    assert is_sleeping(engine_fleet)
    assert sum("exiting sleeping state" in line for line in node.proc.lines) == woken, node.proc.tail(20)
    assert engine_fleet.nodes()["llama-sleepy"]["sleeping"] is True

    # a request pinned to it wakes it, and the fleet sees it awake
    r = engine_fleet.chat(accelerator_id="llama-sleepy", max_tokens=4)
    assert r.status_code == 200, r.text
    assert not is_sleeping(engine_fleet) or sum("exiting sleeping state" in line
                                                for line in node.proc.lines) > woken
