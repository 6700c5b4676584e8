"""The router's local node table: fed by the health service's KV stream and by in-flight
counts, its own and its peers'. Decisions read it without touching the network.

In-flight accounting: every replica counts what it dispatched (``own``) and publishes each
change as a delta, and once a second a snapshot of its own counts. A peer's share is kept
per replica, so a snapshot replaces it exactly (healing a lost delta) and a replica that
falls silent (killed) stops counting after ``PEER_TTL_S``. A node's ``outstanding`` and
``pending`` seen by the policy are own + peers'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from zmlcore.fleet.costs import CostTable
from zmlcore.messages import InflightDelta, InflightSnapshot, NodeState, node_state_decoder
from zmlcore.policy import NodeView

log = logging.getLogger("zml.router.table")

PEER_TTL_S = 3.0

#: Engines with a documented way to continue an assistant message another node started
#: (zml_router.answer.continuation says how each does it).
CONTINUABLE = frozenset({"vllm", "sglang", "tgi", "llamacpp"})


def engine_continues(backend: str) -> bool:
    """Whether a node of this backend can continue an answer another node started."""
    return backend in CONTINUABLE


class NodeTable:
    def __init__(self, configured_families: list[str] | None = None) -> None:
        self.views: dict[str, NodeView] = {}
        self._configured = list(configured_families or ())
        self._families: list[str] | None = None
        # Cached list for choose_node; rebuilt only when membership changes.
        self._list: list[NodeView] | None = None
        #: Called after every state update (the saturation queue re-checks capacity).
        self.on_change: Callable[[], None] | None = None
        #: node id -> [outstanding, pending] dispatched by this replica.
        self.own: dict[str, list[int]] = {}
        #: router id -> (last heard, node id -> [outstanding, pending]).
        self.peers: dict[str, tuple[float, dict[str, list[int]]]] = {}
        #: States as the health service sent them; views carry them with run-time prices.
        self.raw: dict[str, NodeState] = {}
        self.costs = CostTable(on_change=self._cost_changed)

    def families(self) -> list[str]:
        """What a policy's chain may name: zml.toml's families, then those of nodes seen in the
        KV bucket (registered at run time with ``zml nodes add --family``), in that order."""
        if self._families is None:
            seen = dict.fromkeys(self._configured)
            for v in self.views.values():
                seen.setdefault(v.state.family, None)
            self._families = list(seen)
        return self._families

    def pin_unsure(self, node_id: str, model: str) -> bool:
        """Whether a request pinned to ``node_id`` would be refused on what this table holds
        (no such node, not up, the model not loaded), which may be only the watch being behind
        the health service: worth one direct read of the node's entry first."""
        raw = self.raw.get(node_id)
        return raw is None or raw.status != "up" or model not in raw.models

    def nodes(self) -> list[NodeView]:
        if self._list is None:
            self._list = list(self.views.values())
        return self._list

    def cannot_continue(self) -> frozenset[str]:
        """Nodes whose engine has no way to continue an answer another node began
        (engine_continues): left out of a continuation's choice."""
        return frozenset(n for n, v in self.views.items() if not engine_continues(v.state.backend))

    def _cost_changed(self, node_id: str) -> None:
        raw = self.raw.get(node_id)
        if raw is not None:
            self.upsert(raw)

    def upsert(self, state: NodeState) -> None:
        self.raw[state.node_id] = state
        state = self.costs.apply(state)
        view = self.views.get(state.node_id)
        if view is None:
            view = self.views[state.node_id] = NodeView(state)
            self._list = None
            self._families = None
            self._refresh(state.node_id)
        else:
            if view.state.family != state.family:
                self._families = None
            view.state = state

    def remove(self, node_id: str) -> None:
        self.raw.pop(node_id, None)
        if self.views.pop(node_id, None) is not None:
            self._list = None
            self._families = None

    # --- in-flight counts -----------------------------------------------------------------------
    def _refresh(self, node_id: str) -> None:
        view = self.views.get(node_id)
        if view is None:
            return
        out, pend = self.own.get(node_id, (0, 0))
        for _, counts in self.peers.values():
            c = counts.get(node_id)
            if c is not None:
                out += c[0]
                pend += c[1]
        view.set_counts(out, pend)  # one index update for both

    def add_own(self, node_id: str, outstanding: int, pending: int) -> None:
        c = self.own.setdefault(node_id, [0, 0])
        c[0] = max(0, c[0] + outstanding)
        c[1] = max(0, c[1] + pending)
        self._refresh(node_id)

    def own_snapshot(self) -> dict[str, tuple[int, int]]:
        return {n: (c[0], c[1]) for n, c in self.own.items() if c[0] or c[1]}

    def apply_delta(self, d: InflightDelta, now: float) -> None:
        _, counts = self.peers.get(d.router_id, (now, {}))
        c = counts.setdefault(d.node_id, [0, 0])
        c[0] = max(0, c[0] + d.outstanding)
        c[1] = max(0, c[1] + d.pending)
        self.peers[d.router_id] = (now, counts)
        self._refresh(d.node_id)

    def apply_snapshot(self, snap: InflightSnapshot, now: float) -> None:
        _, old = self.peers.get(snap.router_id, (now, {}))
        new = {n: [o, p] for n, (o, p) in snap.nodes.items()}
        self.peers[snap.router_id] = (now, new)
        for node_id in set(old) | set(new):
            self._refresh(node_id)

    def expire_peers(self, now: float) -> list[str]:
        gone = [r for r, (seen, _) in self.peers.items() if now - seen > PEER_TTL_S]
        for router_id in gone:
            _, counts = self.peers.pop(router_id)
            for node_id in counts:
                self._refresh(node_id)
        return gone

    # --- the node bucket (fed by zmlcore.bus.kvfollow.KVFollower) -------------------------------
    def put_raw(self, key: str, value: bytes) -> None:
        try:
            self.upsert(node_state_decoder.decode(value))
        except msgspec.DecodeError as exc:
            log.warning("bad node state for %s: %s", key, exc)
            return
        if self.on_change is not None:
            self.on_change()

    def delete_raw(self, key: str) -> None:
        self.remove(key)
        if self.on_change is not None:
            self.on_change()

    def fresh_for(self, node_id: str, stale_after_s: float, now: float) -> float:
        """Seconds until the node's state is stale (0 if unknown or stale already, at most
        ``stale_after_s``): how long a node the KV bucket lost without a delete marker is kept.
        Routing already skips a stale node; then the follower removes it from the table."""
        raw = self.raw.get(node_id)
        if raw is None:
            return 0.0
        return min(stale_after_s, max(0.0, stale_after_s - (now - raw.updated_at)))
