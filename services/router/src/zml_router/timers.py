"""Per-request deadlines on one timer wheel instead of a timer each.

Every request armed an ``asyncio.timeout`` for its own deadline and another for its attempt's
first byte: a Timeout object, a TimerHandle pushed on the loop's heap and, since almost every
request finishes long before its deadline, a cancelled handle left on that heap (~3.5 us per
request and deadline). Here a deadline is an entry in the dict of its slot (``TICK_S`` wide):
arming and disarming are a dict insert and delete, and one loop timer wakes the wheel when the
earliest slot that still holds a timer is due (slots emptied by cancels are skipped, so a router
whose requests all finish in time wakes about once per deadline length, not once per request).
Memory: at most one small dict per 5 ms of the longest deadline (max_request_timeout_s).
A deadline fires at most one tick late (5 ms, on timeouts of seconds) and, like any loop timer
under uvloop, up to 1 ms early. Late is not wrong for a client, even at timeout_ms = 10: the
gateway waits the timeout + 1 s and the SDK + 0.25 s or more for the router's TIMEOUT, no node
call has a total timeout of its own to race it, and an attempt's first-byte deadline that falls
in the request deadline's tick fires after it (a slot fires in arming order): TIMEOUT, not a
failover that cools the node.

    wheel = Wheel()                         # one per router: one event loop at a time
    with wheel.deadline(2.0):               # as ``async with asyncio.timeout(2.0):``
        await something()                   # TimeoutError once 2 s have passed
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from types import TracebackType

#: Width of a slot: how late a deadline may fire.
TICK_S = 0.005
#: How early it may fire: the event loop's own timer resolution (uvloop: 1 ms).
EARLY_S = 0.001


class Timer:
    """One armed callback; :meth:`cancel` disarms it (O(1), idempotent)."""

    __slots__ = ("_slot", "_fire")

    def __init__(self, slot: dict[Timer, None] | None, fire: Callable[[], None]) -> None:
        self._slot = slot
        self._fire = fire

    def cancel(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.pop(self, None)


class Wheel:
    def __init__(self, tick_s: float = TICK_S) -> None:
        self.tick_s = tick_s
        #: slot number -> its armed timers (insertion-ordered dicts: O(1) removal on cancel).
        self._slots: dict[int, dict[Timer, None]] = {}
        self._order: list[int] = []  # heap of the slot numbers in _slots
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: int | None = None
        #: The loop it serves, once known (asyncio.get_running_loop costs a getpid syscall on 3.11).
        self.loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return sum(len(s) for s in self._slots.values())

    def call_at(self, when: float, fire: Callable[[], None]) -> Timer:
        """Call ``fire()`` once the loop's clock passes ``when`` (at most a tick later)."""
        n = math.ceil(when / self.tick_s)  # the slot's time n * tick_s is >= when
        slot = self._slots.get(n)
        if slot is None:
            slot = self._slots[n] = {}
            heapq.heappush(self._order, n)
            if self._armed_for is None or n < self._armed_for:
                self._arm(n)
        t = Timer(slot, fire)
        slot[t] = None
        return t

    def deadline(self, seconds: float, stay: Callable[[], bool] | None = None) -> Deadline:
        return Deadline(self, seconds, stay)

    def watch(self, period: float, progress: Callable[[], int] | None = None) -> Watch:
        return Watch(self, period, progress)

    def running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self.loop
        if loop is None or loop.is_closed():
            loop = self.loop = asyncio.get_running_loop()
        return loop

    def _arm(self, n: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_for = n
        self._handle = self.running_loop().call_at(n * self.tick_s, self._run)

    def _run(self) -> None:
        self._handle = self._armed_for = None
        # uvloop's timers have 1 ms resolution and may wake up to that much before the slot's time:
        # a slot due within it runs now (as any loop timer would), not at a re-armed wake-up.
        now = self.running_loop().time() + EARLY_S
        order = self._order
        while order and order[0] * self.tick_s <= now:
            slot = self._slots.pop(heapq.heappop(order))
            for t in list(slot):
                t._slot = None
                t._fire()
        # Slots whose timers were all cancelled (nearly every request ends long before its
        # deadlines) are dropped here instead of waking the loop when their time comes.
        slots = self._slots
        while order and not slots[order[0]]:
            del slots[heapq.heappop(order)]
        if order:
            self._arm(order[0])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._armed_for = None
        self._slots.clear()
        self._order.clear()


class _TaskTimer:
    """Cancels the task it is entered in when its timer fires, and turns that cancellation (and
    only that one: not a cancel from elsewhere) into :attr:`error` on the way out, exactly as
    ``asyncio.timeout`` does (the same ``uncancel`` accounting)."""

    __slots__ = ("_wheel", "_seconds", "_task", "_cancelling", "_timer", "_fired")
    error: type[Exception] = TimeoutError

    def __init__(self, wheel: Wheel, seconds: float) -> None:
        self._wheel = wheel
        self._seconds = seconds
        self._fired = False
        self._timer: Timer | None = None

    def __enter__(self) -> _TaskTimer:
        loop = self._wheel.running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError(f"{type(self).__name__} used outside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._timer = self._wheel.call_at(loop.time() + self._seconds, self._expire)
        return self

    def _expire(self) -> None:
        self._timer = None
        self._fired = True
        self._task.cancel()

    @property
    def expired(self) -> bool:
        return self._fired

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise self.error from exc


class Deadline(_TaskTimer):
    """``with wheel.deadline(s):`` cancels the task at the deadline: TimeoutError on the way out.
    ``stay``, asked when the deadline comes: True lets the task run on for another ``s`` (then
    it is asked again), as for a request that has nowhere better to go."""

    __slots__ = ("_stay",)

    def __init__(self, wheel: Wheel, seconds: float, stay: Callable[[], bool] | None = None) -> None:
        super().__init__(wheel, seconds)
        self._stay = stay

    def _expire(self) -> None:
        if self._stay is not None and self._stay():
            self._timer = self._wheel.call_at(self._wheel.running_loop().time() + self._seconds, self._expire)
            return
        super()._expire()


class Stalled(Exception):
    """A :class:`Watch`'s counter did not move for a whole period."""


class Watch(_TaskTimer):
    """``with wheel.watch(period) as w:`` cancels the task when ``w.ticks`` has not moved for a
    whole ``period`` (so a stall is noticed within one to two periods): :class:`Stalled` on the
    way out. The watched loop only increments ``w.ticks``: no clock read and no timer armed per
    step, one wheel timer per period."""

    __slots__ = ("_seen", "ticks", "_progress")
    error = Stalled

    def __init__(self, wheel: Wheel, period: float, progress: Callable[[], int] | None = None) -> None:
        super().__init__(wheel, period)
        self.ticks = 0
        self._seen = 0
        #: Read instead of ``ticks`` when given (e.g. bytes a connection has received).
        self._progress = progress

    def _now(self) -> int:
        return self._progress() if self._progress is not None else self.ticks

    def __enter__(self) -> Watch:
        self._seen = self._now()
        super().__enter__()
        return self

    def _expire(self) -> None:
        now = self._now()
        if now != self._seen:  # it moved: look again a period from now
            self._seen = now
            self._timer = self._wheel.call_at(self._wheel.running_loop().time() + self._seconds, self._expire)
            return
        super()._expire()
