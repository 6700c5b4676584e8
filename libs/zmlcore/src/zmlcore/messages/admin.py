"""Run-time node registration: ``zml.admin.nodes.add|remove|list`` (health service).

A request is JSON; a success reply is the Struct below, an error reply carries the header
``Zml-Error-Code`` and an :class:`~zmlcore.errors.ErrorBody` (the one wire form of errors).
Nodes added here are kept in the JetStream KV bucket ``zml_registry`` and survive restarts of the
health service. Client functions: :mod:`zmlcore.fleet.registry`.

Example (raw NATS)::

    nats req zml.admin.nodes.add '{"node": {"id": "mi300x-9", "accelerator": "amd_mi300x",
        "endpoint": "http://10.0.1.9:8000", "models": ["meta-llama/llama-3-8b-instruct"]}}'
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Backend = Literal["vllm", "tgi", "sglang", "llamacpp", "openai"]


class KVEventsSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A node's KV-event sockets: the keys of zml.toml's ``[nodes.kv_events]``."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class NodeSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """A node to register: the same keys as a ``[[nodes]]`` entry of zml.toml (no sim table,
    no api_key: secrets stay in zml.toml)."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")]
    accelerator: str
    endpoint: str
    backend: Backend = "vllm"
    models: list[str] = []
    served_names: dict[str, str] = {}
    family: str | None = None
    cost_per_hour: Annotated[float, msgspec.Meta(ge=0)] | None = None
    probe_endpoint: str | None = None
    startup_grace_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    kv_events: KVEventsSpec | None = None
    #: Disaggregated prefill/decode (docs/disaggregation.md): the legs it takes, its KV group
    #: and link bandwidth (Gbit/s). None: zml.toml's defaults (both roles, no group).
    roles: list[Literal["prefill", "decode"]] | None = None
    kv_group: str | None = None
    kv_gbps: Annotated[float, msgspec.Meta(gt=0)] | None = None
    kv_bootstrap_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None


class NodeAdd(msgspec.Struct, frozen=True, kw_only=True):
    """``zml.admin.nodes.add``. ``replace``: overwrite a node with the same id (else an error)."""

    node: NodeSpec
    replace: bool = False


class NodeRemove(msgspec.Struct, frozen=True, kw_only=True):
    """``zml.admin.nodes.remove``. A node from zml.toml is removed until it is added again."""

    node_id: str


class NodeAdded(msgspec.Struct, frozen=True, kw_only=True):
    node: NodeSpec
    #: True when an existing registration was replaced.
    replaced: bool = False


class NodeRemoved(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str


class RegistryEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Value of one key of the ``zml_registry`` KV bucket. ``node`` None with ``removed``: a
    tombstone hiding a zml.toml node."""

    node: NodeSpec | None = None
    removed: bool = False
    at: float = 0.0


node_add_decoder = msgspec.json.Decoder(NodeAdd)
node_remove_decoder = msgspec.json.Decoder(NodeRemove)
registry_entry_decoder = msgspec.json.Decoder(RegistryEntry)
