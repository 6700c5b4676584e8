"""The KV-event stream's ordering state machine: gaps replayed, restarts and losses reset."""

from __future__ import annotations

from zmlcore.fleet.kvevents.sequence import Deliver, Ordering, Replay, Reset


def seqs(actions: list[object]) -> list[object]:
    return [a.seq if isinstance(a, Deliver) else a for a in actions]


def test_in_order_is_delivered() -> None:
    o = Ordering(can_replay=True)
    assert seqs(o.live(0, b"a") + o.live(1, b"b")) == [0, 1]


def test_a_gap_is_replayed_and_held_messages_follow() -> None:
    o = Ordering(can_replay=True)
    o.live(0, b"0")
    assert o.live(3, b"3") == [Replay(1)]
    assert o.live(4, b"4") == []  # held while replaying
    out = o.replayed(1, b"1") + o.replayed(2, b"2") + o.replayed(3, b"3") + o.replayed(-1, b"")
    assert seqs(out) == [1, 2, 3, 4]
    assert o.next_seq == 5 and o.resets == 0


def test_a_replay_that_no_longer_has_the_gap_resets() -> None:
    o = Ordering(can_replay=True)
    o.live(0, b"0")
    assert o.live(5, b"5") == [Replay(1)]
    out = o.replayed(3, b"3") + o.replayed(4, b"4") + o.replayed(5, b"5") + o.replayed(-1, b"")
    assert isinstance(out[0], Reset) and seqs(out[1:]) == [3, 4, 5]


def test_an_unanswered_replay_releases_held_with_a_reset() -> None:
    o = Ordering(can_replay=True)
    o.live(0, b"0")
    o.live(2, b"2")
    out = o.replay_done()  # the bridge gave up waiting
    assert isinstance(out[0], Reset) and seqs(out[1:]) == [2]
    assert o.replayed(1, b"1") == []  # a late answer is ignored


def test_without_replay_a_gap_resets_at_once() -> None:
    o = Ordering(can_replay=False)
    o.live(0, b"0")
    out = o.live(2, b"2")
    assert isinstance(out[0], Reset) and seqs(out[1:]) == [2]


def test_numbering_going_back_is_a_restart() -> None:
    o = Ordering(can_replay=True)
    o.live(0, b"0"), o.live(1, b"1"), o.live(2, b"2")
    out = o.live(0, b"new0")
    assert out[0] == Reset("the engine restarted") and seqs(out[1:]) == [0]
    out = Ordering(can_replay=True)
    out.live(0, b""), out.live(1, b""), out.live(2, b"")
    actions = out.live(1, b"late joiner of a new engine")
    assert actions[0] == Reset("the engine restarted") and actions[1] == Replay(0)


def test_joining_late_replays_from_zero_without_reset() -> None:
    o = Ordering(can_replay=True)
    assert o.live(40, b"40") == [Replay(0)]
    out = o.replayed(30, b"30") + o.replayed(39, b"39") + o.replayed(40, b"40") + o.replayed(-1, b"")
    # 30 is the oldest the engine still buffers: nothing was known before, so nothing to reset;
    # 31..38 missing in the replay itself is a loss.
    assert seqs(out)[0] == 30 and isinstance(out[1], Reset) and seqs(out[2:]) == [39, 40]
    assert o.next_seq == 41
