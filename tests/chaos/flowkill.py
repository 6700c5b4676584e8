"""A router killed while it holds queued requests of two bands (issue 30): the scenario of
test_chaos_flow.py and benches/flow_chaos.py.

The stack of tests/flowstack.py (two routers, one 4-slot MI300X sim, ``[flow] hold_when_full``).
Four long requests fill the node, 6 ``standard`` then 6 ``critical`` short ones wait in the
saturation queue (each router holding a window of it), then a router that announces holding
``critical`` entries (``zml.queue_busy``) is killed with SIGKILL. When each waiting request left the queue is
exact: the router's enqueue time (``Zml-Enqueued``, read off the queue's subject) plus the
``queued_ms`` its reply carries, both on the routers' clock.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field

import msgspec
import nats

from conftest import Stack
from flowstack import ROUTERS, body
from zmlcore import subjects as S
from zmlcore.flowctl.bands import CRITICAL
from zmlcore.messages import queue_busy_decoder

#: Two dispatches closer than this are not told apart (``queued_ms`` is whole milliseconds).
TIE_S = 0.002


@dataclass
class Queued:
    rid: str
    band: str
    answers: int
    errors: list[str]
    #: When it left the queue (routers' clock), None if never
    left: float | None


@dataclass
class Run:
    victim: str
    #: The best band each router announced holding just before the kill (0 critical)
    bands: dict[str, int]
    killed_at: float
    queued: list[Queued] = field(default_factory=list)
    holds_answered: int = 0
    #: When the holding requests' answers came back (routers' clock)
    holds_done: list[float] = field(default_factory=list)

    def order(self) -> list[Queued]:
        return sorted((q for q in self.queued if q.left is not None), key=lambda q: q.left or 0.0)

    def sequence(self) -> str:
        """The order they left the queue in: C critical, s standard."""
        return "".join("C" if q.band == "critical" else "s" for q in self.order())

    def inversions(self) -> list[tuple[str, str, float]]:
        """(standard, critical, seconds earlier): a standard request that left the queue before a
        critical one."""
        std = [q for q in self.queued if q.band == "standard" and q.left is not None]
        crit = [q for q in self.queued if q.band == "critical" and q.left is not None]
        return [(s.rid, c.rid, round(c.left - s.left, 3)) for s in std for c in crit  # type: ignore[operator]
                if s.left < c.left - TIE_S]  # type: ignore[operator]

    def after_kill(self, band: str) -> list[float]:
        return sorted(round(q.left - self.killed_at, 3) for q in self.queued if q.band == band and q.left is not None)

    def summary(self) -> str:
        once = sum(1 for q in self.queued if q.answers == 1)
        return (f"{self.victim} killed (announced bands {self.bands}): queued answered once {once}/{len(self.queued)}, "
                f"lost {[q.rid for q in self.queued if q.answers == 0]}, "
                f"twice {[q.rid for q in self.queued if q.answers > 1]}, "
                f"errors {[q.errors for q in self.queued if q.errors]}; left the queue in order {self.sequence()} "
                f"({len(self.inversions())} standard-before-critical pairs); seconds after the kill: critical "
                f"{self.after_kill('critical')}, standard {self.after_kill('standard')}; holding requests answered "
                f"{self.holds_answered} at {sorted(round(t - self.killed_at, 2) for t in self.holds_done)}")


async def one_run(stack: Stack, tag: str, prefer: str) -> Run:
    """One kill; ``prefer``: the victim when both routers hold critical entries."""
    nc = await nats.connect(stack.nats_url)
    enqueued: dict[str, float] = {}
    bands: dict[str, tuple[int, float]] = {}

    async def on_queue(msg) -> None:  # type: ignore[no-untyped-def]
        h = msg.headers or {}
        rid = h.get(S.H_REQUEST_ID, "")
        if rid and S.H_QUEUE_ENQUEUED in h:
            enqueued.setdefault(rid, float(h[S.H_QUEUE_ENQUEUED]))

    async def on_busy(msg) -> None:  # type: ignore[no-untyped-def]
        try:
            b = queue_busy_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if b.router:
            bands[b.router] = (b.band, b.until)

    subs = [await nc.subscribe(S.QUEUE_SUBJECT_PREFIX + ".>", cb=on_queue), await nc.subscribe(S.QUEUE_BUSY, cb=on_busy)]
    holds_done: list[float] = []
    try:
        async def req(tenant: str, rid: str, max_tokens: int, band: str) -> tuple[str, str, int, list[str], int | None]:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            headers = {S.H_REQUEST_ID: f"{rid}-{tag}", S.H_TIMEOUT_MS: "30000", S.H_OWNER: f"key:{tenant}",
                       S.H_PRIORITY: band}
            await nc.publish(S.FRONT_DOOR_INFER, body(max_tokens), reply=inbox, headers=headers)
            replies = []
            try:  # every reply within 12 s (a second one would be a request served twice)
                while True:
                    replies.append(await sub.next_msg(timeout=12 if not replies else 1.0))
                    if rid.startswith("hold"):
                        holds_done.append(time.time())
            except Exception:
                pass
            ok = [m for m in replies if S.H_ERROR_CODE not in (m.headers or {}) and m.data]
            errors = [(m.headers or {})[S.H_ERROR_CODE] for m in replies if S.H_ERROR_CODE in (m.headers or {})]
            queued_ms = json.loads(ok[0].data).get("zml", {}).get("queued_ms") if ok else None
            return rid, band, len(ok), errors, queued_ms

        hold = [asyncio.create_task(req("base", f"hold-{i}", 1500, "standard")) for i in range(4)]
        await asyncio.sleep(0.3)
        waiting = [asyncio.create_task(req("std", f"std-{i}", 8, "standard")) for i in range(6)]
        await asyncio.sleep(0.1)
        waiting += [asyncio.create_task(req("vip", f"crit-{i}", 8, "critical")) for i in range(6)]
        await asyncio.sleep(0.4)
        now = time.time()
        live = {r: b for r, (b, until) in bands.items() if until > now}
        holders = [r for r in ROUTERS if live.get(r) == CRITICAL]
        victim = prefer if prefer in holders or not holders else holders[0]
        proc = stack.procs.pop(victim)
        proc.popen.send_signal(signal.SIGKILL)
        run = Run(victim, live, time.time())
        proc.popen.wait(10)
        held = await asyncio.gather(*hold)
        for rid, band, answers, errors, queued_ms in await asyncio.gather(*waiting):
            enq = enqueued.get(f"{rid}-{tag}")
            left = None if queued_ms is None or enq is None else enq + queued_ms / 1000
            run.queued.append(Queued(rid, band, answers, errors, left))
        run.holds_answered = sum(x[2] for x in held)
        run.holds_done = holds_done
        return run
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


def restart(stack: Stack, victim: str) -> None:
    stack.start_router(victim)
    assert stack.procs[victim].wait_for("started", 30), stack.procs[victim].tail()
    time.sleep(2)  # the peers' snapshots: each counts the other again
