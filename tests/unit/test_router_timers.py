"""zml_router.timers: the router's timer wheel and the deadlines on it (asyncio.timeout's
semantics: TimeoutError for its own expiry only, never early, at most a tick late)."""

from __future__ import annotations

import asyncio
import math
import selectors

import pytest

from zml_router.timers import EARLY_S, TICK_S, Stalled, Wheel


class _VirtualSelector(selectors.DefaultSelector):
    """Polls for real I/O without waiting; where the loop would wait for its next timer, the
    virtual clock jumps to it instead. Nothing the machine's load does can make a timer late."""

    def __init__(self, now: float) -> None:
        super().__init__()
        self.now = now

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(0)
        if not events:
            if timeout is None:  # no timer due and nothing ready: the test would wait forever
                raise RuntimeError("the virtual-time loop has nothing scheduled")
            self.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio's own loop (its scheduling, call_at and handles untouched) on a clock that only
    moves when the loop would otherwise sleep, and then exactly to the next timer: the wheel is
    woken on time, so what it fires when is the wheel's doing alone."""

    def __init__(self, now: float) -> None:
        self._vsel = _VirtualSelector(now)
        super().__init__(self._vsel)

    def time(self) -> float:
        return self._vsel.now


@pytest.mark.parametrize("start", [1000.0, 1000.0013, 1000.0049, 123456.789])  # phases within a tick
def test_a_timer_fires_after_its_time_and_within_a_tick(start: float) -> None:
    loop = VirtualTimeLoop(start)

    async def main() -> tuple[list[tuple[float, float]], int]:
        wheel = Wheel()
        fired: list[tuple[float, float]] = []
        t0 = loop.time()
        for delay in (0.05, 0.02, 0.08, 0.0201):  # armed out of order: the wheel re-arms for the earliest
            wheel.call_at(t0 + delay, lambda when=t0 + delay: fired.append((loop.time(), when)))
        await asyncio.sleep(0.3)
        return fired, len(wheel)

    try:
        fired, left = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [round(when - start, 6) for _, when in fired] == [0.02, 0.0201, 0.05, 0.08]
    for at, when in fired:
        # at its slot's time: never before its own, at most a tick after it
        assert at == pytest.approx(math.ceil(when / TICK_S) * TICK_S, abs=1e-9), (at, when)
        assert when - 1e-9 <= at < when + TICK_S, (at, when)
    assert left == 0


async def test_timers_on_the_real_loop_fire_in_order_never_early() -> None:
    """The same on the running loop and wall clock: a smoke check. How late a loaded machine's
    loop wakes is not the wheel's doing, so the upper bound is only "fires at all"."""
    wheel, loop = Wheel(), asyncio.get_running_loop()
    fired: list[tuple[float, float]] = []
    start = loop.time()
    for delay in (0.05, 0.02, 0.08):
        wheel.call_at(start + delay, lambda d=delay: fired.append((loop.time() - start, d)))
    deadline = loop.time() + 10
    while len(fired) < 3 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert [d for _, d in fired] == [0.02, 0.05, 0.08]
    for at, delay in fired:
        assert at >= delay - EARLY_S - 1e-6
    assert len(wheel) == 0


async def test_a_cancelled_timer_never_fires_and_is_forgotten_at_once() -> None:
    wheel, loop = Wheel(), asyncio.get_running_loop()
    fired: list[int] = []
    timers = [wheel.call_at(loop.time() + 0.02, lambda i=i: fired.append(i)) for i in range(1000)]
    for t in timers[1:]:
        t.cancel()
        t.cancel()  # idempotent
    assert len(wheel) == 1  # removed from its slot, not left to expire
    await asyncio.sleep(0.2)
    assert fired == [0]


async def test_deadline_raises_timeout_error() -> None:
    wheel = Wheel()
    loop = asyncio.get_running_loop()
    t = loop.time()
    with pytest.raises(TimeoutError):
        with wheel.deadline(0.05):
            await asyncio.sleep(5)
    assert 0.05 - EARLY_S - 1e-6 <= loop.time() - t < 2.0
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_deadline_told_to_stay_runs_on_and_asks_again_a_period_later() -> None:
    """An attempt with nowhere else to go waits on past its deadline (zml_router.node.relay):
    asked at each period's end, the deadline fires the first time the answer is no."""
    wheel = Wheel()
    loop = asyncio.get_running_loop()
    asked: list[float] = []
    t = loop.time()

    def stay() -> bool:
        asked.append(loop.time() - t)
        return len(asked) < 3

    with pytest.raises(TimeoutError):
        with wheel.deadline(0.05, stay):
            await asyncio.sleep(5)
    assert len(asked) == 3 and 0.15 - 3 * EARLY_S - 1e-6 <= loop.time() - t < 2.0, asked
    with wheel.deadline(0.05, lambda: True) as d:  # a task that ends while staying: nothing fires
        await asyncio.sleep(0.12)
    assert not d.expired and len(wheel) == 0


async def test_deadline_not_reached_changes_nothing() -> None:
    wheel = Wheel()
    with wheel.deadline(5.0) as d:
        await asyncio.sleep(0.01)
    assert not d.expired and len(wheel) == 0


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    """A requester's cancel (zml.cancel) must not turn into a timeout."""
    wheel = Wheel()

    async def work() -> None:
        with wheel.deadline(5.0):
            await asyncio.sleep(5)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_nested_deadlines_the_outer_one_wins_when_it_passes_first() -> None:
    """The request's deadline (outer) passing during an attempt's first-byte deadline (inner):
    the inner one lets the cancellation through, the outer one raises TimeoutError."""
    wheel = Wheel()
    seen: list[str] = []

    async def work() -> None:
        try:
            with wheel.deadline(0.05):
                try:
                    with wheel.deadline(5.0):
                        await asyncio.sleep(5)
                except TimeoutError:
                    seen.append("inner timeout")
                except asyncio.CancelledError:
                    seen.append("inner cancelled")
                    raise
        except TimeoutError:
            seen.append("outer timeout")

    await work()
    assert seen == ["inner cancelled", "outer timeout"]


async def test_deadlines_due_in_one_tick_are_the_outer_ones() -> None:
    """An attempt's first-byte deadline that falls in the same tick as the request's (the wheel
    fires a whole slot at once, the request's armed first): TIMEOUT, not a failover (which would
    cool the node for a slowness the request's deadline ended anyway)."""
    wheel = Wheel()
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    for _ in range(5):
        seen.clear()
        try:
            with wheel.deadline(0.05):
                # The inner deadline's time, a hair before the outer's: the same slot.
                inner_s = 0.05 - (loop.time() % wheel.tick_s) / 10
                try:
                    with wheel.deadline(inner_s):
                        await asyncio.sleep(5)
                except TimeoutError:
                    seen.append("inner timeout")
                except asyncio.CancelledError:
                    seen.append("inner cancelled")
                    raise
        except TimeoutError:
            seen.append("outer timeout")
        assert seen == ["inner cancelled", "outer timeout"]
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_inner_deadline_first_is_the_inner_ones() -> None:
    wheel = Wheel()
    with wheel.deadline(5.0) as outer:
        with pytest.raises(TimeoutError):
            with wheel.deadline(0.03):
                await asyncio.sleep(5)
        await asyncio.sleep(0.01)  # the outer deadline still holds, the task is not cancelled
    assert not outer.expired


def test_deadlines_fire_under_uvloop() -> None:
    """The services run on uvloop (zmlcore.runtime.runner): its loop has other internals and 1 ms timers."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> list[float]:
        wheel, loop = Wheel(), asyncio.get_running_loop()
        took = []
        for delay in (0.013, 0.0301, 0.002):
            t = loop.time()
            with pytest.raises(TimeoutError):
                with wheel.deadline(delay):
                    await asyncio.sleep(5)
            took.append(loop.time() - t - delay)
        return took

    for late in uvloop.run(main()):
        assert -EARLY_S - 1e-6 <= late < TICK_S + 0.1


async def test_slots_emptied_by_cancels_do_not_wake_the_loop(monkeypatch) -> None:
    """Requests that end before their deadlines leave empty slots behind: the wheel skips them
    (one wake-up for a run of them, not one per slot)."""
    wheel, loop = Wheel(), asyncio.get_running_loop()
    runs = 0
    real = wheel._run

    def counted() -> None:
        nonlocal runs
        runs += 1
        real()

    monkeypatch.setattr(wheel, "_run", counted)
    start = loop.time()
    first = wheel.call_at(start + 0.01, lambda: None)
    for i in range(40):  # 40 "requests" in 40 later slots, all finished in time
        wheel.call_at(start + 0.02 + i * TICK_S, lambda: None).cancel()
    fired: list[bool] = []
    wheel.call_at(start + 0.02 + 45 * TICK_S, lambda: fired.append(True))
    await asyncio.sleep(0.02 + 45 * TICK_S + 0.2)
    assert fired == [True]
    assert not first._slot  # fired
    assert runs == 2  # the first slot, then straight to the last one


async def test_a_watch_cancels_only_when_its_counter_stands_still_for_a_period() -> None:
    wheel = Wheel()
    loop = asyncio.get_running_loop()
    with wheel.watch(0.05) as w:  # ticking: never fires, however long
        for _ in range(12):
            w.ticks += 1
            await asyncio.sleep(0.02)
    t0 = loop.time()
    with pytest.raises(Stalled):
        with wheel.watch(0.05) as w:
            w.ticks += 1
            await asyncio.sleep(5)  # silent: noticed within one to two periods
    assert 0.05 - EARLY_S <= loop.time() - t0 < 0.1 + 2 * TICK_S + 0.2


async def test_a_watch_leaves_a_cancel_from_elsewhere_alone() -> None:
    wheel = Wheel()

    async def body() -> None:
        with wheel.watch(5.0):
            await asyncio.sleep(5)

    task = asyncio.ensure_future(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(wheel) == 0
