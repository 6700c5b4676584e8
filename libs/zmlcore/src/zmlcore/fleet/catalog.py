"""Which models the fleet knows, and what a request for a model no node serves is told. Pure.

A model is the fleet's when zml.toml names it (``[models]``, a node's ``models``) or a node
serves it, loads it or is configured for it (``NodeState.models``, ``loading_models``,
``missing_models``: nodes added at run time count too). ``GET /v1/models`` lists exactly those;
``GET /v1/models/ID``, a request and ``zml serve`` say the same thing about any other name: it
does not exist. For a known model no node serves, the hint given is the one that can work:
``zml serve`` when a node that is up is configured for it, else what is missing.

>>> from zmlcore.messages import NodeState
>>> up = NodeState(node_id="a", accelerator_type="cpu", family="CPU", endpoint="http://a", status="up",
...                missing_models=["m"])
>>> unserved_message("gpt-5", {"m"}, [up])
"The model 'gpt-5' does not exist: no node serves it or is configured to (GET /v1/models lists the models)"
>>> unserved_message("m", {"m"}, [up]) is None  # `zml serve m` loads it on a: the router's hint stands
True
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from zmlcore.errors import ModelNotLoadedError, ZMLError
from zmlcore.messages import NodeState

__all__ = ["does_not_exist", "known_models", "unserved", "unserved_message"]


def known_models(configured: Collection[str], nodes: Iterable[NodeState]) -> set[str]:
    """zml.toml's model names (``configured``) and every node's served, loading and configured ones."""
    out = set(configured)
    for st in nodes:
        out.update(st.models)
        out.update(st.loading_models)
        out.update(st.missing_models)
    return out


def does_not_exist(model: str) -> str:
    return (f"The model {model!r} does not exist: no node serves it or is configured to "
            "(GET /v1/models lists the models)")


def unserved_message(model: str, configured: Collection[str], nodes: Iterable[NodeState]) -> str | None:
    """Why no node serves ``model`` when `zml serve` cannot help; None when it can (a node that
    is up, or coming up, is configured for it)."""
    nodes = list(nodes)
    if model not in known_models(configured, nodes):
        return does_not_exist(model)
    mine = [st for st in nodes if model in st.missing_models or model in st.loading_models or model in st.models]
    if not mine:
        return (f"model {model!r} is not served by any node and no node is configured to serve it: list it in a "
                "node's models in zml.toml (or `zml nodes add --serves`)")
    if all(st.status in ("down", "invalid") for st in mine):
        why = "; ".join(f"{st.node_id}: {st.status}" + (f" ({st.reason})" if st.reason else "") for st in mine[:3])
        return f"model {model!r} is not loaded on any available node: its nodes are not up ({why})"
    return None


def unserved(exc: ZMLError, model: str, configured: Collection[str], nodes: Iterable[NodeState]) -> ZMLError:
    """``exc``, or for a MODEL_NOT_LOADED whose `zml serve` hint cannot work, the same error
    saying what can (see :func:`unserved_message`)."""
    if not isinstance(exc, ModelNotLoadedError):
        return exc
    message = unserved_message(model, configured, nodes)
    if message is None:
        return exc
    context = dict(exc.routing_context or {})
    context["recommendation"] = "GET /v1/models lists the models" if message.startswith("The model") else message
    return ModelNotLoadedError(message, routing_context=context or None)
