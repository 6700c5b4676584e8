"""Keep child processes running: a child that exits is started again after a backoff, and the
restart is logged. Used by `zml up` (services, sim fleet, embedded nats-server).

The backoff is a pure policy (:class:`Backoff`); :class:`Supervisor` applies it to processes
started by PID through :mod:`zmlcore.runtime.launch`. It never stops on a child's death: only its owner
stops it (on SIGINT/SIGTERM), and then every child is signalled at once and waited for; a
second Ctrl-C kills them (:meth:`Supervisor.kill_all`).

    sup = Supervisor()
    sup.add("router-1", lambda: spawn("router-1", argv))
    while not stopping:
        sup.tick()
        time.sleep(0.2)
    sup.stop_all()
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zmlcore.runtime.launch import Proc


@dataclass
class Backoff:
    """Delay before restart number n: ``initial`` doubling up to ``maximum``; a child that ran
    for ``reset_after`` seconds starts again from ``initial`` (a crash a day is not a crash loop)."""

    initial: float = 0.5
    maximum: float = 10.0
    reset_after: float = 60.0
    _next: float = 0.0

    def delay(self, uptime: float) -> float:
        """The delay before restarting a child that ran ``uptime`` seconds (advances the state)."""
        if self._next == 0.0 or uptime >= self.reset_after:
            self._next = self.initial
        d = self._next
        self._next = min(self._next * 2, self.maximum)
        return d


@dataclass
class Child:
    name: str
    start: Callable[[], Proc]
    proc: Proc | None = None
    backoff: Backoff = field(default_factory=Backoff)
    started_at: float = 0.0
    restart_at: float | None = None
    restarts: int = 0
    #: Exit codes seen, newest last (bounded): for status lines and tests.
    exits: list[int] = field(default_factory=list)


def _log(msg: str) -> None:
    print(f"zml up: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, *, log: Callable[[str], None] = _log, clock: Callable[[], float] = time.monotonic,
                 backoff: Callable[[], Backoff] = Backoff) -> None:
        self.children: list[Child] = []
        self._log = log
        self._clock = clock
        self._backoff = backoff

    def add(self, name: str, start: Callable[[], Proc]) -> Child:
        """Start a child now and keep it running."""
        child = Child(name, start, backoff=self._backoff())
        self.children.append(child)
        self._start(child)
        return child

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.started_at = self._clock()
        try:
            child.proc = child.start()
        except Exception as exc:  # e.g. nats-server did not open its port in time
            child.proc = None
            self._schedule(child, f"failed to start ({exc})", 0.0)

    def _schedule(self, child: Child, why: str, uptime: float) -> None:
        delay = child.backoff.delay(uptime)
        child.restart_at = self._clock() + delay
        self._log(f"{child.name} {why}; restarting in {delay:g} s (restart {child.restarts + 1})")

    def tick(self) -> None:
        """Notice exits and restart children whose backoff has passed. Call it often."""
        now = self._clock()
        for child in self.children:
            if child.restart_at is None and child.proc is not None and not child.proc.alive():
                code = child.proc.popen.returncode
                child.exits = [*child.exits[-19:], code]
                uptime = now - child.started_at
                tail = child.proc.tail(5)
                self._schedule(child, f"(pid {child.proc.pid}) exited with code {code} after {uptime:.1f} s"
                               + (f"; last output:\n{tail}" if tail else ""), uptime)
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                self._start(child)
                if child.proc is not None:
                    self._log(f"{child.name} restarted (pid {child.proc.pid})")

    def kill_all(self) -> None:
        """SIGKILL every child still running (a second Ctrl-C: the user will not wait for drains);
        a :meth:`stop_all` under way then finds them gone. Safe in a signal handler."""
        for c in self.children:
            if c.proc is not None and c.proc.popen.poll() is None:
                c.proc.popen.kill()

    def stop_all(self) -> None:
        """Signal every child at once, then wait for each (stopping one by one adds up drains)."""
        procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            proc.terminate()
        for proc in reversed(procs):
            proc.stop()
