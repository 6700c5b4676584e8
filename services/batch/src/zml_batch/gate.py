"""How many lines of one model a runner keeps in flight: as many as the routers accept
(sans-I/O: time is passed in).

The routers admit a batch line (``Zml-Priority: batch``) only where a node has room beyond
what interactive traffic needs, and refuse it at once otherwise (QUEUE_FULL): that refusal is
the headroom signal. The gate turns it into a window, like TCP's congestion window:

* a line that was not refused within ``ACCEPT_S`` was taken by a node: the window grows by one
  (so it doubles every round while the fleet has room);
* a refusal shrinks the window to what is in flight (plus one probe) and blocks new sends for a
  backoff that doubles while refusals continue (from ``FLOOR_S`` to ``CAP_S``);
* a line that ends frees the slot it held: one more may go at once (a refused probe costs a NATS
  round trip and a router decision, no node time).

So when interactive load rises the runner stops adding lines at its next send, and its lines
in flight are not replaced as they finish; when it falls, the window refills within a few rounds.

    gate = Gate(ceiling=256)
    if gate.may_send(now): gate.sent(); ...
    gate.accepted() | gate.refused(now, retry_after) | gate.ended()
"""

from __future__ import annotations

from dataclasses import dataclass

#: A line not refused within this long is taken to be accepted (a refusal takes a round trip).
ACCEPT_S = 0.25
FLOOR_S = 0.05
CAP_S = 2.0


@dataclass(slots=True)
class Gate:
    ceiling: int
    window: float = 4.0
    in_flight: int = 0
    blocked_until: float = 0.0
    backoff: float = 0.0
    refusals: int = 0

    def may_send(self, now: float) -> bool:
        return self.in_flight < min(self.ceiling, int(self.window)) and now >= self.blocked_until

    def sent(self) -> None:
        self.in_flight += 1

    def accepted(self) -> None:
        """A line was taken by a node (not refused within ACCEPT_S)."""
        self.window = min(float(self.ceiling), self.window + 1.0)
        self.backoff = 0.0

    def refused(self, now: float, retry_after: float | None = None) -> None:
        """A line was refused for want of room: it is no longer in flight."""
        self.in_flight -= 1
        self.refusals += 1
        self.window = float(max(1, self.in_flight + 1))
        self.backoff = min(CAP_S, max(FLOOR_S, self.backoff * 2))
        wait = self.backoff if retry_after is None else min(CAP_S, max(self.backoff, retry_after))
        self.blocked_until = max(self.blocked_until, now + wait)

    def ended(self, now: float) -> None:
        """A line that was taken ended (answered, or failed on its node): its slot is free."""
        self.in_flight -= 1
        self.blocked_until = min(self.blocked_until, now)

    def wait_s(self, now: float) -> float:
        """How long until a send could be allowed without anything else happening."""
        return max(0.0, self.blocked_until - now)
