"""FleetIndex: per-model columns of every node's scoring terms, kept exact at O(1) per change.

Each node has its own measured, drifting speeds (health's EWMA), so nodes are not grouped by
speed: a model's :class:`ModelTable` keeps one row per node, family by family, in numpy
columns (load key, drain key, 1/prefill speed, cost per unit of capacity, depth, state age,
cooldown). A row is recomputed with the pure functions of :mod:`~zmlcore.policy.estimate`
whenever its :class:`NodeView` changes (a counter, a cooldown or a polled state): O(1), no
re-indexing unless a node's family or set of models changes. A decision then evaluates every
row's estimate ``key + P/pf`` in a few vector operations (see :mod:`~zmlcore.policy.context`).

The router keeps one index over its views and passes it as ``nodes`` to
:func:`~zmlcore.policy.choose_node` (it is a ``Sequence[NodeView]``)::

    fleet = FleetIndex(views)            # once, and again when nodes are added or removed
    decision = choose_node(fleet, req, policy, now, state)   # reads the index, never writes it
    fleet.get(decision.node_id).outstanding += 1              # the index follows (O(1))

Passing a plain list works too: a throw-away index is built per call (O(n)).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from zmlcore.policy.estimate import INF, MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, Coeffs, node_cost, node_speeds
from zmlcore.policy.types import NodeView


class FamilyGroup:
    """The rows ``start:stop`` of one family in a :class:`ModelTable`.

    Row indices are table-wide, so ``views``, ``keys``, ``drains`` are the table's columns
    (what the strategies index with a candidate's ``i``).
    """

    __slots__ = ("family", "table", "k", "start", "stop")

    def __init__(self, family: str, table: ModelTable, k: int, start: int, stop: int) -> None:
        self.family = family
        self.table = table
        #: index in the table's ``families`` / ``groups``
        self.k = k
        self.start = start
        self.stop = stop

    @property
    def views(self) -> list[NodeView]:
        return self.table.views

    @property
    def keys(self) -> np.ndarray:
        return self.table.key

    @property
    def drains(self) -> np.ndarray:
        return self.table.drain


ChainView = tuple[list[tuple[str, list[FamilyGroup]]], list[int], np.ndarray, list[int]]


class ModelTable:
    """Every node that serves (or is loading) one model: one row each, grouped by family in
    registration order (first node seen), nodes in registration order within a family."""

    __slots__ = (
        "model", "families", "by_family", "groups", "starts", "group_of", "chains", "counts", "flat", "views", "coeffs", "inputs",
        "up", "fam", "key", "drain", "pf", "inv_pf", "cost_cap", "cost_ok", "depth", "updated", "blocked", "health",
    )

    def __init__(self, model: str, views: list[NodeView], families: list[str]) -> None:
        n = len(views)
        self.model = model
        self.views = views
        #: families as first written, in registration order
        self.families = families
        self.groups: list[FamilyGroup] = []
        #: first row of each group (every group has one)
        self.starts = np.zeros(0, dtype=np.intp)
        #: the group of each row
        self.group_of: list[FamilyGroup] = []
        #: per chain: (families in chain order with their groups, rank of each table family as
        #: a list and an array, nodes per chain family); a cache for Ctx, filled on first use
        self.chains: dict[tuple[str, ...], ChainView] = {}
        self.by_family: dict[str, list[FamilyGroup]] = {}
        self.counts: dict[str, int] = {}
        #: (group, row) in node registration order (round robin's cycle)
        self.flat: list[tuple[FamilyGroup, int]] = []
        self.coeffs: list[Coeffs | None] = [None] * n
        #: (pf, dec, maxc, cost) each row's Coeffs were computed from
        self.inputs: list[tuple[float, float, int, float] | None] = [None] * n
        #: status up and the model loaded (not only loading)
        self.up = [False] * n
        #: family number (index in ``families``) of each row
        self.fam = np.zeros(n, dtype=np.int32)
        #: Coeffs.load_key / drain_key of the node's counters; INF while not routable
        #: (status not up, or the model only loading)
        self.key = np.full(n, INF)
        self.drain = np.full(n, INF)
        self.pf = np.ones(n)
        self.inv_pf = np.ones(n)
        self.cost_cap = np.zeros(n)
        #: cost_cap where the load key is finite, else INF
        self.cost_ok = np.full(n, INF)
        #: effective outstanding requests (the strategies' queue depth)
        self.depth = np.zeros(n)
        #: state's updated_at; max(cooldown_until, saturated_until); health score
        self.updated = np.zeros(n)
        self.blocked = np.zeros(n)
        self.health = np.zeros(n)


def _membership(v: NodeView) -> tuple[str, frozenset[str]]:
    st = v.state
    return st.family, frozenset(st.models).union(st.loading_models)


class FleetIndex(Sequence[NodeView]):
    """All nodes one router routes over, indexed per model (see the module docstring).

    ``watch=False`` builds a snapshot index that does not follow later changes (what
    :func:`choose_node` does for a plain list).
    """

    def __init__(
        self,
        nodes: Sequence[NodeView],
        *,
        watch: bool = True,
        mean_prompt: float = MEAN_PROMPT_TOKENS,
        mean_output: float = MEAN_OUTPUT_TOKENS,
    ) -> None:
        self._views = list(nodes)
        self._by_id = {v.node_id: v for v in self._views}
        self.mean_prompt = mean_prompt
        self.mean_output = mean_output
        self._tables: dict[str, ModelTable] = {}
        self._where: dict[str, list[tuple[ModelTable, int]]] = {}
        #: (family, models + loading models) of each node when its tables were built
        self._member: dict[str, tuple[str, frozenset[str]]] = {}
        self._watching = watch
        #: full table builds so far (after a membership change); the bench and tests read it
        self.rebuilds = 0
        if watch:
            for v in self._views:
                v._watchers.append(self)

    # --- Sequence[NodeView] ---
    def __len__(self) -> int:
        return len(self._views)

    @overload
    def __getitem__(self, i: int) -> NodeView: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeView]: ...
    def __getitem__(self, i: int | slice) -> NodeView | Sequence[NodeView]:
        return self._views[i]

    def __iter__(self) -> Iterator[NodeView]:
        return iter(self._views)

    def get(self, node_id: str) -> NodeView | None:
        return self._by_id.get(node_id)

    def close(self) -> None:
        """Stop following the views (call before dropping a watching index)."""
        if self._watching:
            for v in self._views:
                if self in v._watchers:
                    v._watchers.remove(self)
            self._watching = False

    # --- upkeep: O(1) per change ---
    def _node_changed(self, view: NodeView, structural: bool) -> None:
        where = self._where.get(view.node_id, ())
        if structural and self._tables:
            old = self._member.get(view.node_id)
            st = view.state
            if old is None or old[0] != st.family or old[1] != frozenset(st.models).union(st.loading_models):
                # A node joins or leaves a model's table, or changes family: rebuild lazily.
                self._tables.clear()
                self._where.clear()
                self._member.clear()
                return
            for table, j in where:
                self._set_state(table, j, view)
            return
        for table, j in where:
            self._set_counters(table, j, view)

    def _set_state(self, t: ModelTable, j: int, v: NodeView) -> None:
        st = v.state
        pf, dec, maxc = node_speeds(st)
        inputs = (pf, dec, maxc, node_cost(st))
        if t.inputs[j] != inputs:
            t.inputs[j] = inputs
            c = t.coeffs[j] = Coeffs(*inputs, self.mean_prompt, self.mean_output)
            t.pf[j] = c.pf
            t.inv_pf[j] = c.inv_pf
            t.cost_cap[j] = c.cost_cap
        up = t.up[j] = st.status == "up" and t.model in st.models
        t.cost_ok[j] = t.cost_cap[j] if up else INF
        t.updated[j] = st.updated_at
        t.health[j] = st.health_score
        self._set_counters(t, j, v)

    @staticmethod
    def _set_counters(t: ModelTable, j: int, v: NodeView) -> None:
        out = v.effective_outstanding()
        t.depth[j] = out
        t.blocked[j] = max(v.cooldown_until, v.saturated_until)
        if t.up[j]:
            c = t.coeffs[j]
            assert c is not None
            t.key[j] = c.load_key(out, v.effective_pending())
            t.drain[j] = c.drain_key(out)
        else:
            t.key[j] = INF
            t.drain[j] = INF

    # --- tables ---
    def table(self, model: str) -> ModelTable:
        t = self._tables.get(model)
        if t is None:
            t = self._tables[model] = self._build(model)
        return t

    def _build(self, model: str) -> ModelTable:
        self.rebuilds += 1
        families: list[str] = []
        rows: dict[str, list[NodeView]] = {}
        for v in self._views:
            st = v.state
            self._member.setdefault(v.node_id, _membership(v))
            if model not in st.models and model not in st.loading_models:
                continue
            fl = st.family.lower()
            if fl not in rows:
                families.append(st.family)
                rows[fl] = []
            rows[fl].append(v)
        ordered = [v for f in families for v in rows[f.lower()]]
        t = ModelTable(model, ordered, families)
        row_of: dict[str, int] = {}
        start = 0
        for k, fam in enumerate(families):
            members = rows[fam.lower()]
            g = FamilyGroup(fam, t, k, start, start + len(members))
            t.groups.append(g)
            t.by_family[fam.lower()] = [g]
            t.counts[fam.lower()] = len(members)
            t.fam[start:start + len(members)] = k
            for j in range(start, start + len(members)):
                v = ordered[j]
                row_of[v.node_id] = j
                self._set_state(t, j, v)
                self._where.setdefault(v.node_id, []).append((t, j))
            start += len(members)
        t.starts = np.array([g.start for g in t.groups], dtype=np.intp)
        group_of = t.group_of = [t.groups[int(k)] for k in t.fam]
        for v in self._views:
            j = row_of.get(v.node_id, -1)
            if j >= 0:
                t.flat.append((group_of[j], j))
        return t

    def where(self, node_id: str, table: ModelTable) -> int | None:
        """The row of ``node_id`` in ``table`` (None if it does not serve the table's model)."""
        for t, j in self._where.get(node_id, ()):
            if t is table:
                return j
        return None

