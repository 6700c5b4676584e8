"""Which nodes can hand KV to which, and how fast: the kv_group and link table of zml.toml.

Pure data built once per configuration (or node-state) change: two nodes can be the legs of
one split request when they share a ``kv_group``; the transfer runs at the pair's
``[[kv_links]]`` bandwidth, else at the slower end's ``kv_gbps``.

    links = KVLinks.from_config(cfg.kv_links)
    links.bytes_per_s(prefill_state, decode_state)   # None: they cannot hand KV over
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zmlcore.messages import NodeState

_GBIT = 1e9 / 8.0


class KVLinks:
    """Bandwidth between two nodes' KV transfer ends, bytes/s.

    >>> a = NodeState(node_id="a", accelerator_type="nvidia_h100", family="H100", endpoint="",
    ...               kv_group="g", kv_gbps=100.0)
    >>> b = NodeState(node_id="b", accelerator_type="amd_mi300x", family="MI300X", endpoint="",
    ...               kv_group="g", kv_gbps=50.0)
    >>> KVLinks().bytes_per_s(a, b) / 1e9
    6.25
    >>> KVLinks({("a", "b"): 200.0}).bytes_per_s(b, a) / 1e9
    25.0
    """

    __slots__ = ("_pairs",)

    def __init__(self, pairs: dict[tuple[str, str], float] | None = None) -> None:
        #: (node, node) -> Gbit/s, both orders (a link carries KV either way).
        self._pairs: dict[tuple[str, str], float] = {}
        for (p, d), gbps in (pairs or {}).items():
            self._pairs[(p, d)] = self._pairs[(d, p)] = gbps

    @property
    def explicit(self) -> dict[tuple[str, str], float]:
        """The pairs with a bandwidth of their own, both orders (Gbit/s)."""
        return self._pairs

    @classmethod
    def from_config(cls, links: Iterable[Any]) -> KVLinks:
        """From ``cfg.kv_links`` (entries with ``prefill``, ``decode``, ``gbps``)."""
        return cls({(ln.prefill, ln.decode): ln.gbps for ln in links})

    def gbps(self, p: NodeState, d: NodeState) -> float | None:
        """The pair's bandwidth in Gbit/s; None when they share no kv_group."""
        if not p.kv_group or p.kv_group != d.kv_group or p.node_id == d.node_id:
            return None
        explicit = self._pairs.get((p.node_id, d.node_id))
        if explicit is not None:
            return explicit
        ends = [g for g in (p.kv_gbps, d.kv_gbps) if g > 0]
        return min(ends) if ends else None

    def bytes_per_s(self, p: NodeState, d: NodeState) -> float | None:
        g = self.gbps(p, d)
        return None if g is None else g * _GBIT
