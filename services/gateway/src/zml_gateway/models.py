"""``GET /v1/models`` and ``GET /v1/models/{id}``: OpenAI's model objects for the models of
zml.toml and of every node in the KV bucket, with the nodes serving each now."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zmlcore.config import ZMLConfig
from zmlcore.errors import ModelNotLoadedError
from zmlcore.fleet.catalog import does_not_exist, known_models
from zmlcore.messages import NodeState


def _object(cfg: ZMLConfig, nodes: Mapping[str, NodeState], name: str) -> dict[str, Any]:
    serving = [s.node_id for s in nodes.values() if name in s.models and s.status == "up"]
    zml: dict[str, Any] = {"nodes_up": serving}
    mc = cfg.models.get(name)
    if mc is not None and mc.embedding:
        zml["embedding"] = True
    if mc is not None and mc.audio:
        zml["audio"] = True
    return {"id": name, "object": "model", "owned_by": "zml", "created": 0, "zml": zml}


def model_list(cfg: ZMLConfig, nodes: Mapping[str, NodeState]) -> dict[str, Any]:
    names = known_models(cfg.model_names(), nodes.values())
    return {"object": "list", "data": [_object(cfg, nodes, name) for name in sorted(names)]}


def model_object(cfg: ZMLConfig, nodes: Mapping[str, NodeState], model_id: str) -> dict[str, Any]:
    """The model object of ``model_id`` (an alias answers for its model); 404 when unknown."""
    name = cfg.resolve_model(model_id)
    if name in known_models(cfg.model_names(), nodes.values()):
        return _object(cfg, nodes, name)
    raise ModelNotLoadedError(does_not_exist(model_id))
