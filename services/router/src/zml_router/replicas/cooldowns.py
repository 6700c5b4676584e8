"""Cooldown and saturation marks, shared between router replicas (sans-I/O).

A replica that sees a node fail (network error, 5xx, no first byte in time, a stream broken
after its first token) cools it down; one that gets "overloaded" marks it saturated. Each mark
is applied to the local table and returned as a :class:`NodeMark` for the service to publish
on ``zml.node.marks``; peers apply it with :meth:`Marks.apply_peer`. A mark only ever extends
a node's skip window (the later end wins), and carries a duration rather than a wall-clock time
so that replicas on different hosts need no synchronised clocks.

Half-open probing stays local (``zmlcore.policy.admission``): a replica that lets one request
through early does not clear its peers' marks; a failure of that probe is shared again.
"""

from __future__ import annotations

from zmlcore.messages import NodeMark
from zmlcore.messages.node import RECOVERED

from zml_router.replicas.table import NodeTable


class Marks:
    def __init__(self, table: NodeTable, router_id: str) -> None:
        self.table = table
        self.router_id = router_id
        #: node id -> (until, reason, router that set it) of its current cooldown.
        self.why: dict[str, tuple[float, str, str]] = {}

    def mark(self, node_id: str, kind: str, for_s: float, reason: str, now: float) -> NodeMark | None:
        """Apply our own verdict; the returned mark is for the peers (None: unknown node)."""
        if not self._apply(node_id, kind, for_s, reason, self.router_id, now):
            return None
        return NodeMark(router_id=self.router_id, node_id=node_id, kind=kind,  # type: ignore[arg-type]
                        for_s=for_s, reason=reason, ts=now)

    def apply_peer(self, mark: NodeMark, now: float) -> bool:
        """A peer's mark (our own echoes are ignored). True if it changed the table."""
        if mark.router_id == self.router_id:
            return False
        # A malformed or hostile duration must not take a node out for ever.
        for_s = min(max(mark.for_s, 0.0), 3600.0)
        return self._apply(mark.node_id, mark.kind, for_s, mark.reason, mark.router_id, now)

    def _apply(self, node_id: str, kind: str, for_s: float, reason: str, by: str, now: float) -> bool:
        view = self.table.views.get(node_id)
        if view is None:
            return False
        if for_s <= 0:  # the health service probed a cooled-down node back into service
            if kind == "cooldown" and reason == RECOVERED and view.cooldown_until > now:
                view.cooldown_until = 0.0
                self.why.pop(node_id, None)
                return True
            return False
        until = now + for_s
        if kind == "cooldown":
            if until <= view.cooldown_until:
                return False
            view.cooldown_until = until
            self.why[node_id] = (until, reason, by)
            return True
        if kind == "saturated":
            if until <= view.saturated_until:
                return False
            view.saturated_until = until
            return True
        return False

    def describe(self, node_id: str, now: float) -> dict[str, str]:
        """Why a node is cooling down, for the router's state reply."""
        until, reason, by = self.why.get(node_id, (0.0, "", ""))
        if until <= now:
            return {}
        return {"cooldown_reason": reason, "cooldown_by": by}
