"""Which of an engine's model names are the fleet's, and what a node configured for a model its
engine does not serve is told. Pure.

An engine names its models its own way (a path, a GGUF file, llama-server's ``--alias``); the
node's ``served_names`` map ZML's names to them. A name that maps to no model the fleet knows
(zml.toml's models, every registered node's, what warmup loaded on the node) is the engine's
alone: it is not routed to and not listed by ``GET /v1/models``, so an alias never becomes a
public model by accident. A node whose engine serves such a name instead of the model it was
added for is almost always a missing ``served_names`` entry: its note says which.

>>> s = split_models(["mid"], configured=["acme/tiny-chat"], served_names={}, known={"acme/tiny-chat"})
>>> s.models, s.unknown
([], ['mid'])
>>> mismatch_note("cpu-mid", ["acme/tiny-chat"], s.unknown, source="registry")
"its engine serves 'mid', not 'acme/tiny-chat': give the engine's name with `zml nodes add cpu-mid ... --served-name acme/tiny-chat=mid --replace`"
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from zmlcore.config import AdapterConfig, NodeConfig


@dataclass(frozen=True, slots=True)
class Split:
    #: ZML's names of the models the engine serves (routable).
    models: list[str]
    #: The engine's names that are no model of the fleet's.
    unknown: list[str]


def split_models(engine_models: Iterable[str], *, configured: Collection[str], served_names: Mapping[str, str],
                 known: Collection[str]) -> Split:
    """The engine's model list in ZML's names, split into the fleet's models and the engine's
    own. A node configured with no models serves whatever its engine has (nothing is unknown)."""
    back = {served: name for name, served in served_names.items()}
    models: list[str] = []
    unknown: list[str] = []
    for m in engine_models:
        name = back.get(m, m)
        if not configured or name in configured or name in known:
            models.append(name)
        else:
            unknown.append(m)
    return Split(models, unknown)


def _names(models: list[str]) -> str:
    return ", ".join(repr(m) for m in models)


def mismatch_note(node_id: str, missing: list[str], unknown: list[str], *, source: str) -> str:
    """What a node that serves other names than the models it was configured for is told ("" when
    it serves them, or serves nothing else: then it is only not loaded)."""
    if not (missing and unknown):
        return ""
    model, name = missing[0], unknown[0]
    if source == "registry":
        fix = f"`zml nodes add {node_id} ... --served-name {model}={name} --replace`"
    else:
        fix = f'[nodes.served_names] "{model}" = "{name}" in zml.toml'
    return f"its engine serves {_names(unknown)}, not {_names(missing)}: give the engine's name with {fix}"


def match_loras(loras: Iterable[tuple[int, str]], adapters: Mapping[str, AdapterConfig],
                models: Collection[str]) -> dict[str, int]:
    """The fleet's adapters among a llama-server's ``--lora`` files ((id, path) pairs): adapter
    name -> id, for each adapter whose base model the node serves and whose ``path`` is the
    file's path as the server was given it, or (when no adapter has that path) the same file
    name. A file no adapter names is the engine's alone: not routed to.

    >>> match_loras([(0, "/srv/lora/pirate.gguf"), (1, "other.gguf")],
    ...             {"tiny-pirate": AdapterConfig(base="tiny", path="lora/pirate.gguf")}, ["tiny"])
    {'tiny-pirate': 0}
    """
    out: dict[str, int] = {}
    files = list(loras)
    for name, ad in sorted(adapters.items()):
        if ad.base not in models or not ad.path:
            continue
        exact = [i for i, p in files if p == ad.path]
        named = [i for i, p in files if posixpath.basename(p) == posixpath.basename(ad.path)]
        found = exact or named
        if found:
            out[name] = found[0]
    return out


def engine_names(node: NodeConfig, routable: list[str], adapters: Mapping[str, AdapterConfig]) -> dict[str, str]:
    """The node's engine names (``NodeState.served_names``); on SGLang, an adapter's is
    "BASE:ADAPTER": its OpenAI routes pick an adapter that way, and run a bare adapter name on
    the base model without it.

    >>> from zmlcore.config import AdapterConfig, NodeConfig
    >>> n = NodeConfig(id="s", accelerator="nvidia_h100", endpoint="http://s", backend="sglang",
    ...                served_names={"llama": "/m/llama"})
    >>> engine_names(n, ["llama", "pirate"], {"pirate": AdapterConfig(base="llama", path="/l/pirate")})
    {'llama': '/m/llama', 'pirate': '/m/llama:pirate'}
    """
    names = dict(node.served_names)
    if node.backend == "sglang":
        for a in routable:
            if a in adapters:
                base = adapters[a].base
                names[a] = f"{node.served_names.get(base, base)}:{a}"
    return names
