"""Inputs and outputs of routing decisions. Pure data: no I/O, no clocks.

The router, the routing simulator (benches/) and the benchmarks all build these and call
:func:`zmlcore.policy.choose_node`; what is benchmarked is what ships.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from zmlcore.messages import NodeState


class _Watcher(Protocol):
    def _node_changed(self, view: NodeView, structural: bool) -> None: ...
    def _counts_changed(self, view: NodeView) -> None: ...


class NodeView:
    """A node as one router sees it: the health service's last state plus local counters.

    ``outstanding``/``pending`` are the router's own (and, shared over NATS, its peers')
    counts of requests dispatched and not finished / not yet at first token. They are exact
    between two polls, so the estimate uses them first and adds only the part of the polled
    queue this router did not know about when the poll arrived (other routers, direct
    clients): ``external = max(0, polled_depth - outstanding_at_poll)``. Assigning ``state``
    snapshots the counters for that purpose.

    Every assignment notifies the :class:`~zmlcore.policy.FleetIndex` objects that hold the
    view, so the router just does ``view.outstanding += 1`` and the index stays exact.

    >>> v = NodeView(NodeState(node_id="n1", accelerator_type="nvidia_h100", family="H100",
    ...                        endpoint="http://h:8000", status="up", models=["m"]))
    >>> v.outstanding += 1; v.node_id
    'n1'
    """

    __slots__ = (
        "_state", "_outstanding", "_pending", "_pending_tokens", "_cooldown_until", "_saturated_until",
        "out_at_poll", "pend_at_poll", "_ext_out", "_ext_pend", "_watchers",
    )

    def __init__(
        self,
        state: NodeState,
        outstanding: int = 0,
        pending: int = 0,
        cooldown_until: float = 0.0,
        saturated_until: float = 0.0,
    ) -> None:
        self._state = state
        self._outstanding = outstanding
        self._pending = pending
        #: Prompt tokens the pending requests still have to prefill (their uncached tokens as
        #: estimated at dispatch), when the caller keeps that count; None: it does not, and
        #: each pending request counts as a mean prompt.
        self._pending_tokens: float | None = None
        self._cooldown_until = cooldown_until
        self._saturated_until = saturated_until
        #: Local counters when ``state`` was last assigned (see the class docstring), and what
        #: the poll saw beyond them (fixed until the next poll; the effective counts add them).
        self.out_at_poll = outstanding
        self.pend_at_poll = pending
        self._ext_out = self._ext_pend = 0
        self._external()
        self._watchers: list[_Watcher] = []

    def _external(self) -> None:
        st = self._state
        self._ext_out = max(0, st.queue_running + st.queue_waiting - self.out_at_poll)
        self._ext_pend = max(0, st.queue_waiting - self.pend_at_poll)

    def _notify(self, structural: bool) -> None:
        for w in self._watchers:
            w._node_changed(self, structural)

    @property
    def state(self) -> NodeState:
        return self._state

    @state.setter
    def state(self, value: NodeState) -> None:
        self._state = value
        self.out_at_poll = self._outstanding
        self.pend_at_poll = self._pending
        self._external()
        self._notify(True)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @outstanding.setter
    def outstanding(self, value: int) -> None:
        self._outstanding = value
        for w in self._watchers:
            w._counts_changed(self)

    @property
    def pending(self) -> int:
        return self._pending

    @pending.setter
    def pending(self, value: int) -> None:
        self._pending = value
        for w in self._watchers:
            w._counts_changed(self)

    @property
    def pending_tokens(self) -> float | None:
        return self._pending_tokens

    @pending_tokens.setter
    def pending_tokens(self, value: float | None) -> None:
        self._pending_tokens = value
        for w in self._watchers:
            w._counts_changed(self)

    def set_counts(self, outstanding: int, pending: int, pending_tokens: float | None = None) -> None:
        """Assign the counters with one index update (the router's in-flight refresh);
        ``pending_tokens`` None leaves that count as it is."""
        if outstanding == self._outstanding and pending == self._pending and (
                pending_tokens is None or pending_tokens == self._pending_tokens):
            return
        self._outstanding = outstanding
        self._pending = pending
        if pending_tokens is not None:
            self._pending_tokens = pending_tokens
        for w in self._watchers:
            w._counts_changed(self)

    @property
    def cooldown_until(self) -> float:
        return self._cooldown_until

    @cooldown_until.setter
    def cooldown_until(self, value: float) -> None:
        self._cooldown_until = value
        if self._watchers:
            self._notify(False)

    @property
    def saturated_until(self) -> float:
        return self._saturated_until

    @saturated_until.setter
    def saturated_until(self, value: float) -> None:
        self._saturated_until = value
        if self._watchers:
            self._notify(False)

    @property
    def node_id(self) -> str:
        return self._state.node_id

    def effective_outstanding(self) -> int:
        """Requests on the node: local counter plus what the last poll saw beyond it."""
        return self._outstanding + self._ext_out

    def effective_pending(self) -> int:
        """Requests not yet at first token (the poll's waiting queue beyond local pending)."""
        return self._pending + self._ext_pend

    def effective_pending_tokens(self, mean_prompt: float) -> float | None:
        """Prompt tokens still to prefill ahead of a new request: the tracked tokens of the
        local pending requests plus a mean prompt for each the poll saw beyond them; None when
        the caller tracks no tokens (then ``pending x mean_prompt`` is the estimate)."""
        if self._pending_tokens is None:
            return None
        return self._pending_tokens + self._ext_pend * mean_prompt

    def __repr__(self) -> str:
        return (
            f"NodeView({self.node_id!r}, outstanding={self._outstanding}, pending={self._pending}, "
            f"cooldown_until={self._cooldown_until}, saturated_until={self._saturated_until})"
        )


@dataclass(slots=True, frozen=True)
class RouteRequest:
    model: str
    #: Prompt length; 0 means unknown (the estimate then uses the mean prompt).
    prompt_tokens: int = 0
    max_tokens: int = 512
    #: Pin to a node (bypasses the policy).
    accelerator_id: str | None = None
    #: Nodes already tried for this request.
    exclude: frozenset[str] = frozenset()
    #: The prompt's key chain (``zmlcore.policy.prefix.prompt_keys``): with a ``cache`` index
    #: passed to ``choose_node``, each node's estimate counts only its uncached tokens.
    prefix: Any = None
    #: The node this request's session is bound to (``user`` / ``x-session-id`` / the SDK's
    #: ``session=``), if any: kept while that node is within the load bound
    #: (``zmlcore.policy.session``), else the policy chooses and the caller rebinds.
    session_node: str | None = None
    #: ``model`` is a LoRA adapter of this base model: besides the nodes holding it, a node
    #: serving the base whose engine loads it for the request may take it, its estimate plus
    #: the load time (zmlcore.policy.estimate.adapter_load_s).
    base: str | None = None

    # The generated __init__ of a frozen dataclass looks object.__setattr__ up per field (1.6 us,
    # once per request); this one binds it once (0.9 us). Same fields, defaults and order
    # (tests/unit/test_policy_helpers.py checks them against dataclasses.fields).
    def __init__(self, model: str, prompt_tokens: int = 0, max_tokens: int = 512, accelerator_id: str | None = None,
                 exclude: frozenset[str] = frozenset(), prefix: Any = None, session_node: str | None = None,
                 base: str | None = None, *, _set: Any = object.__setattr__) -> None:
        _set(self, "model", model)
        _set(self, "prompt_tokens", prompt_tokens)
        _set(self, "max_tokens", max_tokens)
        _set(self, "accelerator_id", accelerator_id)
        _set(self, "exclude", exclude)
        _set(self, "prefix", prefix)
        _set(self, "session_node", session_node)
        _set(self, "base", base)


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
    #: Per family of the chain, what was evaluated. Read-only: over a large table the entries
    #: are shared with other decisions (cached while the table's up nodes do not change).
    evaluated: list[FamilyEval] = field(default_factory=list)
    #: Prompt tokens the chosen node is estimated to hold in its prefix cache.
    cached_tokens: int = 0
    #: Session affinity: "" (no session), "kept" (the bound node), "spilled" (bound node over
    #: the load bound), "moved" (bound node not routable: down, cooling, unknown).
    session: str = ""
    #: Disaggregated: the node that prefills and hands its KV to ``node_id`` (which decodes);
    #: "" for a request served whole (zmlcore.policy.split).
    prefill_node: str = ""
    #: Prompt tokens the decode node is estimated to pull over the link, and the seconds that
    #: takes (a split decision's estimate).
    transfer_tokens: int = 0
    transfer_s: float = 0.0
    #: An adapter's request sent to a node that loads the adapter for it (``adapters_on_request``):
    #: the seconds of load time in ``estimated_ttft_s``; 0 where the node holds it.
    adapter_load_s: float = 0.0


@dataclass(slots=True)
class RoutingState:
    """Mutable per-router state a policy may keep between decisions: the round-robin cursor
    and, for a router that passes the same node list again and again, the FleetIndex built
    over it (the second call with the same list object builds a watching index and keeps it
    until a different list arrives)."""

    rr_cursor: int = 0
    #: FleetIndex over ``fleet_src`` (typed Any: fleet.py imports this module)
    fleet: Any = None
    fleet_src: Any = None
    #: The last plain list seen (identity), to recognise a reused list.
    last_list: Any = None
