"""The shared runner's stop signals, in a real process on a real nats-server: SIGTERM and a first
SIGINT stop gracefully (the service's stop runs to its end), a second SIGINT exits at once with
130 (Ctrl-C again, as uvicorn has it), and SIGTERM never forces (`zml up` sends it right after
the terminal's SIGINT reached the whole group: still one Ctrl-C)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from zmlcore.runtime.launch import Proc, spawn

# A service whose stop takes 30 s (a long drain); it prints when its stop begins and ends.
SERVICE = """
import asyncio, sys
from zmlcore.runtime.runner import run_service

class Slow:
    async def start(self, nc):
        pass

    async def stop(self):
        print("stopping", flush=True)
        await asyncio.sleep(float(sys.argv[2]))
        print("stopped", flush=True)

asyncio.run(run_service(Slow(), sys.argv[1], "zml-test", ready_line="ready"))
"""


def _start(nats_url: str, drain_s: float) -> Proc:
    proc = spawn("slow-service", [sys.executable, "-c", SERVICE, nats_url, str(drain_s)])
    assert proc.wait_for("ready", 30), proc.tail()
    return proc


def _stop_begun(proc: Proc) -> None:
    assert proc.wait_for("stopping", 10), proc.tail()


@pytest.mark.timeout(120)
def test_a_second_sigint_exits_at_once(nats_url: str) -> None:
    proc = _start(nats_url, 30.0)
    try:
        proc.popen.send_signal(signal.SIGINT)
        _stop_begun(proc)
        time.sleep(0.5)
        assert proc.popen.poll() is None  # the graceful stop is under way
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(5) == 130
        assert time.monotonic() - t0 < 3
        assert any("interrupted again while stopping; exiting now" in line for line in proc.lines), proc.tail()
    finally:
        proc.stop()


@pytest.mark.timeout(120)
def test_sigterm_then_sigint_is_one_ctrl_c_and_never_forced_by_sigterm(nats_url: str) -> None:
    proc = _start(nats_url, 2.0)
    try:
        proc.popen.send_signal(signal.SIGINT)  # the terminal's Ctrl-C
        proc.popen.send_signal(signal.SIGTERM)  # zml up's stop right after it
        _stop_begun(proc)
        proc.popen.send_signal(signal.SIGTERM)  # an impatient supervisor: still graceful
        assert proc.popen.wait(15) == 0
        assert any(line.strip() == "stopped" for line in proc.lines), proc.tail()
    finally:
        proc.stop()
