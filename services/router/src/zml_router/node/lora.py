"""What a request tells a llama-server about its LoRA adapters (pure).

llama-server loads adapters only at start (``--lora FILE``, ids 0, 1, ... in that order) and a
request picks them with ``"lora": [{"id": ID, "scale": S}]``: an adapter the list leaves out runs
at scale 0, and a request without the field runs with the server's global scales (1.0 from
start unless ``--lora-init-without-apply``; ``POST /lora-adapters`` changes them). So a request
for an adapter goes with its base model's name and its adapter at scale 1, and a request for
the base model with every adapter off: either one is served as asked whatever the global
scales are. Health publishes each node's ids (``NodeState.lora_ids``, ``lora_count``).

>>> st = NodeState(node_id="n", accelerator_type="cpu", family="cpu", endpoint="",
...                backend="llamacpp", lora_ids={"tiny-pirate": 1}, lora_count=2)
>>> for_node(st, "tiny-pirate", "tiny")
('tiny', ((1, 1.0),))
>>> for_node(st, "tiny", None)
('tiny', ((0, 0.0),))
"""

from __future__ import annotations

from zmlcore.messages import NodeState

#: ``(id, scale)`` pairs for the body's ``lora`` list; None: leave the body's ``lora`` alone.
Lora = tuple[tuple[int, float], ...]


def for_node(st: NodeState, model: str, base: str | None) -> tuple[str, Lora | None]:
    """(the engine's name for the model to send, the ``lora`` list) for a request asking for
    ``model`` (an adapter when ``base`` is its base model) on node ``st``."""
    if not st.lora_count:
        return st.served_names.get(model) or model, None
    ident = st.lora_ids.get(model)
    if base is not None and ident is not None:
        return st.served_names.get(base) or base, ((ident, 1.0),)
    return st.served_names.get(model) or model, ((0, 0.0),)


def as_json(lora: Lora) -> list[dict[str, float]]:
    return [{"id": i, "scale": s} for i, s in lora]
