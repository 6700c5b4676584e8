"""The fleet's models and what a request for one no node serves is told (zmlcore.fleet.catalog)."""

from __future__ import annotations

import doctest

from zmlcore.errors import ModelNotLoadedError, QueueFullError
from zmlcore.fleet import catalog
from zmlcore.fleet.catalog import known_models, unserved
from zmlcore.messages import NodeState


def _node(node_id: str, status: str = "up", **kw: object) -> NodeState:
    return NodeState(node_id=node_id, accelerator_type="cpu", family="CPU", endpoint="http://x",
                     status=status, **kw)  # type: ignore[arg-type]


HINT = ModelNotLoadedError("model 'm' is not loaded on any available node; run `zml serve m`",
                           routing_context={"final_error": "model_not_loaded", "recommendation": "run `zml serve m`"})


def test_doctests() -> None:
    assert doctest.testmod(catalog).failed == 0


def test_known_models_are_the_configs_and_every_nodes() -> None:
    nodes = [_node("a", models=["x"], loading_models=["y"]), _node("b", missing_models=["z"], unknown_models=["mid"])]
    assert known_models({"t"}, nodes) == {"t", "x", "y", "z"}  # an engine's own name is not one


def test_the_hint_stays_only_where_it_works() -> None:
    assert unserved(HINT, "m", set(), [_node("a", missing_models=["m"])]) is HINT
    assert unserved(HINT, "m", set(), [_node("a", loading_models=["m"])]) is HINT
    gone = unserved(HINT, "gpt-5", {"m"}, [_node("a", missing_models=["m"])])
    assert isinstance(gone, ModelNotLoadedError) and "does not exist" in gone.message
    assert gone.routing_context == {"final_error": "model_not_loaded",
                                    "recommendation": "GET /v1/models lists the models"}
    nowhere = unserved(HINT, "m", {"m"}, [_node("a")])  # in [models], on no node
    assert "no node is configured to serve it" in nowhere.message and "zml serve" not in nowhere.message
    down = unserved(HINT, "m", set(), [_node("a", "down", reason="connection refused", missing_models=["m"])])
    assert down.message.endswith("its nodes are not up (a: down (connection refused))")
    other = QueueFullError("full")
    assert unserved(other, "gpt-5", set(), []) is other
