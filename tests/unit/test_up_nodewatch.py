"""What `zml up` prints when nodes change state (zml.cli._nodewatch.Transitions)."""

from __future__ import annotations

import doctest

from zml.cli import _nodewatch
from zml.cli._nodewatch import Transitions
from zmlcore.messages import NodeState


def _st(node_id: str, status: str, reason: str = "", last_ok: float = 0.0) -> NodeState:
    return NodeState(node_id=node_id, accelerator_type="cpu", family="CPU", endpoint="http://x",
                     status=status, reason=reason, last_ok=last_ok)  # type: ignore[arg-type]


def test_doctests() -> None:
    assert doctest.testmod(_nodewatch).failed == 0


def test_the_start_is_quiet_but_for_nodes_already_out() -> None:
    t = Transitions()
    assert t.update([_st("a", "up"), _st("b", "loading"), _st("c", "invalid", "driver too old")], 10.0) == [
        "node c invalid: driver too old"]
    assert t.update([_st("a", "up"), _st("b", "up"), _st("c", "invalid", "driver too old")], 11.0) == []


def test_every_change_after_it_is_one_line() -> None:
    t = Transitions()
    t.update([_st("a", "up")], 0.0)
    assert t.update([_st("a", "loading", "model loading")], 5.0) == ["node a loading: model loading"]
    assert t.update([_st("a", "unknown")], 6.0) == []  # nothing known: nothing said
    assert t.update([_st("a", "down", "timeout", last_ok=4.0)], 7.0) == ["node a down: timeout (last answered 3.0 s ago)"]
    assert t.update([_st("a", "up")], 20.0) == ["node a up again (out for 15.0 s)"]
    assert t.update([_st("a", "up"), _st("n", "loading")], 21.0) == ["node n added (loading)"]
    assert t.update([_st("n", "up")], 22.0) == ["node a removed"]
