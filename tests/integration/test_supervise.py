"""The supervisor behind `zml up`: the backoff policy, and real child processes that crash and are
started again (new PID), never bringing the supervisor down."""

from __future__ import annotations

import sys
import time

from zmlcore.runtime.launch import spawn
from zml.cli._supervise import Backoff, Supervisor


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run() -> None:
    b = Backoff(initial=0.5, maximum=10.0, reset_after=60.0)
    assert [b.delay(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay(61.0) == 0.5  # ran a minute: a fresh start
    assert b.delay(0.1) == 1.0


def _until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_crashing_child_is_restarted_with_backoff_and_logged() -> None:
    logs: list[str] = []
    sup = Supervisor(log=logs.append, backoff=lambda: Backoff(initial=0.2, maximum=0.8))
    crash = sup.add("crash", lambda: spawn("crash", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]))
    steady = sup.add("steady", lambda: spawn("steady", [sys.executable, "-c", "import time; time.sleep(60)"]))
    first_pid = steady.proc.pid  # type: ignore[union-attr]
    try:
        starts = []
        deadline = time.monotonic() + 20
        while crash.restarts < 4 and time.monotonic() < deadline:
            before = crash.restarts
            sup.tick()
            if crash.restarts != before:
                starts.append(time.monotonic())
            time.sleep(0.02)
        assert crash.restarts >= 4 and set(crash.exits) == {3}
        delays = [float(m.split("restarting in ")[1].split(" s")[0]) for m in logs if m.startswith("crash (pid")]
        assert delays[:4] == [0.2, 0.4, 0.8, 0.8], delays  # backing off, not a hot loop
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert all(g >= d for g, d in zip(gaps, delays[1:])), (gaps, delays)  # and waiting that long
        assert any("crash (pid" in m and "exited with code 3" in m and "boom" in m and "restarting in" in m
                   for m in logs), logs
        assert any(m.startswith("crash restarted (pid") for m in logs)
        # A healthy sibling is untouched; killed (-9), it comes back with a new PID.
        assert steady.restarts == 0 and steady.proc.pid == first_pid  # type: ignore[union-attr]
        steady.proc.popen.kill()  # type: ignore[union-attr]

        def back() -> bool:
            sup.tick()
            return steady.proc is not None and steady.proc.alive() and steady.proc.pid != first_pid

        _until(back)
        assert steady.exits == [-9]
    finally:
        sup.stop_all()
    assert all(c.proc is None or not c.proc.alive() for c in sup.children)
