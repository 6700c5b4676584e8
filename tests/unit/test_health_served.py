"""Which of an engine's model names are the fleet's (zml_health.served): an engine's alias never
becomes a public model by accident, and a node named otherwise is told the fix."""

from __future__ import annotations

import doctest

from zml_health import served
from zml_health.served import mismatch_note, split_models


def test_doctests() -> None:
    assert doctest.testmod(served).failed == 0


def test_the_fleets_names_pass_and_the_engines_own_stay_apart() -> None:
    split = split_models(["/models/llama.gguf", "mid", "other-fleet-model"], configured=["llama"],
                         served_names={"llama": "/models/llama.gguf"}, known={"llama", "other-fleet-model"})
    assert split.models == ["llama", "other-fleet-model"] and split.unknown == ["mid"]
    # a node configured with no models serves whatever its engine has
    assert split_models(["mid"], configured=[], served_names={}, known=set()).models == ["mid"]


def test_the_note_names_the_fix_where_the_node_was_defined() -> None:
    note = mismatch_note("cpu-1", ["m"], ["mid"], source="config")
    assert note == "its engine serves 'mid', not 'm': give the engine's name with [nodes.served_names] \"m\" = \"mid\" in zml.toml"
    assert mismatch_note("cpu-1", ["m"], [], source="config") == ""  # only not loaded
    assert mismatch_note("cpu-1", [], ["mid"], source="registry") == ""  # serves its models, and more
