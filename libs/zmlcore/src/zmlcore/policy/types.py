"""Inputs and outputs of routing decisions. Pure data: no I/O, no clocks.

The router, the routing simulator (benches/) and the benchmarks all build these and call
:func:`zmlcore.policy.choose_node`; what is benchmarked is what ships.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zmlcore.messages import NodeState


@dataclass(slots=True)
class NodeView:
    """A node as one router sees it: the health service's last state plus local counters.

    ``outstanding``/``pending`` are the router's own (and, shared over NATS, its peers')
    counts of requests dispatched and not finished / not yet at first token; they are added to
    the polled queue depth so decisions between two polls do not herd.
    """

    state: NodeState
    outstanding: int = 0
    pending: int = 0
    cooldown_until: float = 0.0
    saturated_until: float = 0.0

    @property
    def node_id(self) -> str:
        return self.state.node_id


@dataclass(slots=True, frozen=True)
class RouteRequest:
    model: str
    prompt_tokens: int = 0
    max_tokens: int = 512
    #: Pin to a node (bypasses the policy).
    accelerator_id: str | None = None
    #: Nodes already tried for this request.
    exclude: frozenset[str] = frozenset()


@dataclass(slots=True)
class FamilyEval:
    family: str
    nodes_checked: int
    rejected_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"family": self.family, "nodes_checked": self.nodes_checked}
        if self.rejected_reason:
            out["rejected_reason"] = self.rejected_reason
        return out


@dataclass(slots=True)
class Decision:
    node_id: str
    family: str
    policy: str
    queue_depth: int
    estimated_ttft_s: float = 0.0
    evaluated: list[FamilyEval] = field(default_factory=list)


@dataclass(slots=True)
class RoutingState:
    """Mutable per-router state a policy may keep between decisions (round-robin cursor)."""

    rr_cursor: int = 0
