"""zmlcore.reply.keepalive: the router's book of keepalives due and the requester's watch (pure)."""

from __future__ import annotations

import doctest

import pytest

from zmlcore import subjects
from zmlcore.reply import keepalive
from zmlcore.errors import BadRequestError
from zmlcore.reply.keepalive import MISSES, KeepaliveBook, Silence, after_silence, keepalive_state, parse_interval


def test_doctests() -> None:
    assert doctest.testmod(keepalive).failed == 0


@pytest.mark.parametrize(("value", "seconds"), [(None, None), ("1000", 1.0), ("250", 0.25), ("1", 0.1),
                                                ("99999999", 60.0)])
def test_parse_interval_clamps(value: str | None, seconds: float | None) -> None:
    assert parse_interval(value) == seconds


@pytest.mark.parametrize("value", ["", "abc", "1.5", "0", "-5", "1e3", "x" * 10_000])
def test_parse_interval_refuses_garbage(value: str) -> None:
    with pytest.raises(BadRequestError) as e:
        parse_interval(value)
    assert len(str(e.value)) < 200  # never echoes unbounded input


def test_book_sends_only_after_an_interval_of_silence() -> None:
    book = KeepaliveBook()
    book.add("a", 1.0, now=0.0)
    book.add("b", 0.5, now=0.0)
    assert book.due(0.4) == []
    assert book.due(0.5) == ["b"]
    book.sent("a", 0.9)  # a chunk went out on "a": its keepalive moves
    assert book.due(1.0) == ["b"]
    book.remove("b")
    book.remove("b")  # twice: harmless
    assert book.due(1.8) == []
    assert book.due(1.95) == ["a"]
    assert "b" not in book and len(book) == 1 and book.min_interval() == 1.0
    book.sent("unknown", 5.0)  # replies of requests that asked nothing are not tracked
    assert "unknown" not in book


def test_a_fast_request_never_costs_a_keepalive() -> None:
    book = KeepaliveBook()
    book.add("a", 1.0, now=10.0)
    assert book.due(10.5) == []
    book.remove("a")  # answered within the interval
    assert book.due(100.0) == [] and not book


def test_silence_is_gone_after_misses_intervals_and_not_while_queued() -> None:
    w = Silence(0.5, now=0.0)
    assert w.wait_s(0.0) == MISSES * 0.5
    assert not w.gone(MISSES * 0.5 - 0.01) and w.gone(MISSES * 0.5)
    w.queued()
    assert not w.gone(1000.0) and w.wait_s(1000.0) is None
    w.heard(1000.0)  # the replica that took it out of the queue said "alive"
    assert not w.gone(1001.0) and w.gone(1000.0 + MISSES * 0.5)


@pytest.mark.parametrize(("committed", "resends", "remaining", "expect"), [
    (False, 0, 10.0, "resend"),
    (False, 0, 0.5, "fail"),  # less than an interval left: no time for another router
    (False, 1, 10.0, "fail"),  # one resend only
    (True, 0, 10.0, "fail"),  # part of the answer is out: cannot restart invisibly
])
def test_after_silence(committed: bool, resends: int, remaining: float, expect: str) -> None:
    assert after_silence(committed=committed, resends=resends, remaining_s=remaining, interval_s=1.0) == expect


def test_keepalive_state_tells_keepalives_from_replies() -> None:
    assert keepalive_state(None) is None
    assert keepalive_state({subjects.H_STREAM: "chunk"}) is None
    assert keepalive_state({subjects.H_KEEPALIVE: "alive"}) == "alive"
    assert keepalive_state(keepalive.keepalive_headers(keepalive.QUEUED)) == "queued"


@pytest.mark.parametrize(("kw", "decision"), [
    ({"committed": False, "resumable": False, "parked": False, "blinks": 0, "remaining_s": 5}, "resend"),
    ({"committed": True, "resumable": True, "parked": False, "blinks": 2, "remaining_s": 5}, "resume"),
    ({"committed": True, "resumable": False, "parked": False, "blinks": 0, "remaining_s": 5}, "fail"),
    ({"committed": False, "resumable": False, "parked": True, "blinks": 0, "remaining_s": 5}, "wait"),
    ({"committed": False, "resumable": False, "parked": False, "blinks": keepalive.MAX_BLINKS, "remaining_s": 5},
     "fail"),
    ({"committed": False, "resumable": False, "parked": False, "blinks": 0, "remaining_s": 0}, "fail"),
])
def test_after_a_reconnect(kw: dict, decision: str) -> None:  # type: ignore[type-arg]
    assert keepalive.after_reconnect(**kw) == decision
