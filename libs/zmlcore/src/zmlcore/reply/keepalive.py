"""Router keepalives on reply subjects, and what a requester makes of silence (sans-I/O).

A router killed mid-request takes the request with it: nothing more ever arrives on its reply
subject. A requester that can tell "still working" from "gone" can send the request again to
another replica long before its timeout. So a requester that handles it declares
``Zml-Keepalive: <ms>`` on its request; while the router holds such a request and has sent
nothing on its reply subject for that long, it sends a keepalive there: an empty message with
header ``Zml-Keepalive: alive``. A request parked in the saturation queue gets one
``Zml-Keepalive: queued`` instead, and nothing while it waits (the queue's claims hand it to
another replica if its holder dies, so the requester must not send it again); the replica that
takes it out of the queue says ``alive`` again before it runs it. Requests that do not declare
the header never get a keepalive (a raw ``request()`` would take one for the reply), and a
request that finishes within one interval never costs one either.

The router side is :class:`KeepaliveBook` (what is due, walked by one periodic task); the
requester side is :class:`Silence` (when the router counts as gone) and :func:`after_silence`
(send again, or end with a clean error). Both take time as an argument.

Example (requester)::

    watch = Silence(interval_s=1.0, now=t0)
    ...on every message: watch.heard(now), or watch.queued() for a "queued" keepalive
    if watch.gone(now):
        match after_silence(committed=..., resends=..., remaining_s=..., interval_s=1.0):
            case "resend": ...
            case "fail": ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from zmlcore import subjects
from zmlcore.errors import BadRequestError

#: Bounds of a declared interval: below, keepalives would cost more than the work they watch;
#: above, a dead router is noticed too late to matter.
MIN_INTERVAL_MS = 100
MAX_INTERVAL_MS = 60_000
#: The router counts as gone after this many intervals without a message. One interval of
#: silence is normal (the router sends only when it has sent nothing for an interval, and its
#: periodic task ticks at a fraction of it); three leave room for a busy event loop.
MISSES = 3
#: Keepalive states (the header's value on a keepalive message).
ALIVE = "alive"
QUEUED = "queued"


def parse_interval(value: str | None) -> float | None:
    """Seconds between keepalives a request asks for (None: it did not ask). Out-of-range
    values are clamped; anything but a positive integer is BAD_REQUEST."""
    if value is None:
        return None
    try:
        ms = int(value)
    except ValueError:
        raise BadRequestError(f"{subjects.H_KEEPALIVE} must be an integer (milliseconds), got {value[:40]!r}") from None
    if ms <= 0:
        raise BadRequestError(f"{subjects.H_KEEPALIVE} must be positive, got {ms}")
    return min(max(ms, MIN_INTERVAL_MS), MAX_INTERVAL_MS) / 1000.0


def keepalive_headers(state: str = ALIVE) -> dict[str, str]:
    return {subjects.H_KEEPALIVE: state}


def keepalive_state(headers: dict[str, str] | None) -> str | None:
    """``alive`` / ``queued`` for a keepalive message, None for anything else (a reply)."""
    if not headers:
        return None
    return headers.get(subjects.H_KEEPALIVE)


class KeepaliveBook:
    """The router's requests that asked for keepalives: reply subject -> (interval, last send).

    >>> book = KeepaliveBook()
    >>> book.add("_INBOX.a", 1.0, now=0.0)
    >>> book.due(0.5), book.due(1.0), book.due(1.5)
    ([], ['_INBOX.a'], [])
    >>> book.sent("_INBOX.a", 2.2); book.due(2.9)
    []
    """

    __slots__ = ("_entries", "on_first")

    def __init__(self) -> None:
        self._entries: dict[str, list[float]] = {}
        #: Called when an entry goes into an empty book: wakes a sender parked while it was empty.
        self.on_first: Callable[[], None] | None = None

    def add(self, reply: str, interval_s: float, now: float) -> None:
        if not self._entries and self.on_first is not None:
            self.on_first()
        self._entries[reply] = [interval_s, now]

    def remove(self, reply: str) -> None:
        self._entries.pop(reply, None)

    def sent(self, reply: str, now: float) -> None:
        """Something went out on ``reply``: its next keepalive is an interval from now."""
        entry = self._entries.get(reply)
        if entry is not None:
            entry[1] = now

    def due(self, now: float) -> list[str]:
        """Reply subjects silent for their interval; each counts as sent now."""
        out = []
        for reply, entry in self._entries.items():
            if now - entry[1] >= entry[0]:
                entry[1] = now
                out.append(reply)
        return out

    def min_interval(self) -> float | None:
        return min((e[0] for e in self._entries.values()), default=None)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, reply: object) -> bool:
        return reply in self._entries


class Silence:
    """The requester's watch on one attempt: gone after ``MISSES`` intervals with nothing
    heard, except while the request waits in the saturation queue.

    >>> w = Silence(1.0, now=0.0)
    >>> w.gone(2.9), w.gone(3.0)
    (False, True)
    >>> w.heard(2.5); w.gone(5.0), w.wait_s(5.0)
    (False, 0.5)
    >>> w.queued(); w.gone(100.0), w.wait_s(100.0)
    (False, None)
    """

    __slots__ = ("interval_s", "last", "parked")

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self.last = now
        self.parked = False

    def heard(self, now: float) -> None:
        """A reply message or an ``alive`` keepalive arrived."""
        self.last = now
        self.parked = False

    def queued(self) -> None:
        """The request waits in the saturation queue: silence means nothing until it leaves."""
        self.parked = True

    def offline(self, now: float) -> None:
        """The requester's broker connection is down: nothing can arrive, so silence says
        nothing of the router; count from ``now`` (a reconnect sends the request again)."""
        self.last = now

    def wait_s(self, now: float) -> float | None:
        """Seconds until the router counts as gone (None: not while queued)."""
        if self.parked:
            return None
        return max(0.0, self.last + MISSES * self.interval_s - now)

    def gone(self, now: float) -> bool:
        return not self.parked and now - self.last >= MISSES * self.interval_s


def after_silence(*, committed: bool, resends: int, remaining_s: float,
                  interval_s: float, max_resends: int = 1,
                  resumable: bool = False) -> Literal["resend", "resume", "fail"]:
    """The router went silent. Send the request again (same id, new reply inbox) when nothing
    of its answer has been passed on yet, it has not been sent again already, and enough of its
    timeout is left for another router to do something with it. A stream that relayed content
    (``committed``) cannot be restarted invisibly: with ``resumable`` (the requester knows what
    it received: zmlcore.reply.resume) it is sent again as a continuation of it, once more than
    a plain resend may be (its first router may have been a dead one too). Else end it now
    with a clean retryable error rather than wait out its timeout.

    >>> after_silence(committed=False, resends=0, remaining_s=10, interval_s=1)
    'resend'
    >>> after_silence(committed=True, resends=0, remaining_s=10, interval_s=1)
    'fail'
    >>> after_silence(committed=True, resends=1, remaining_s=10, interval_s=1, resumable=True)
    'resume'
    >>> after_silence(committed=False, resends=1, remaining_s=10, interval_s=1)
    'fail'
    """
    if remaining_s < interval_s:
        return "fail"
    if committed:
        return "resume" if resumable and resends < max_resends + 1 else "fail"
    return "fail" if resends >= max_resends else "resend"


#: Broker reconnects a request lives through, sent again after each; past it CONNECTION_FAILED.
MAX_BLINKS = 3


def after_reconnect(*, committed: bool, resumable: bool, parked: bool, blinks: int,
                    remaining_s: float) -> Literal["resend", "resume", "wait", "fail"]:
    """The requester's broker connection came back while its request was in flight. Messages
    published meanwhile (the request itself, the router's replies, a stream's chunks) may be
    lost, and the router cannot tell. So send the request again (same id, ``Zml-Resend``, a
    new inbox: the router that holds it replaces it), as a continuation of what was received
    for a stream already relayed (``resumable``); a request waiting in the saturation queue
    (``parked``) is not sent again: the queue is kept by JetStream and hands it on. A reply
    already partly passed on that cannot be continued (a reply in parts), a request with no
    time left, or one that lived through MAX_BLINKS reconnects already: fail (CONNECTION_FAILED).

    >>> after_reconnect(committed=False, resumable=False, parked=False, blinks=0, remaining_s=5)
    'resend'
    >>> after_reconnect(committed=True, resumable=True, parked=False, blinks=0, remaining_s=5)
    'resume'
    >>> after_reconnect(committed=True, resumable=False, parked=False, blinks=0, remaining_s=5)
    'fail'
    >>> after_reconnect(committed=False, resumable=False, parked=True, blinks=0, remaining_s=5)
    'wait'
    """
    if blinks >= MAX_BLINKS or remaining_s <= 0:
        return "fail"
    if committed:
        return "resume" if resumable else "fail"
    return "wait" if parked else "resend"
