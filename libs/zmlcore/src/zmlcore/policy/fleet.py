"""FleetIndex: per-model columns of every node's scoring terms, kept exact at O(1) per change.

Each node has its own measured, drifting speeds (health's EWMA), so nodes are not grouped by
speed: a model's :class:`ModelTable` keeps one row per node, family by family, in columns
(load key, drain key, 1/prefill speed, cost per unit of capacity, depth, state age, cooldown).
A row is recomputed with the pure functions of :mod:`~zmlcore.policy.estimate` whenever its
:class:`NodeView` changes (a counter, a cooldown or a polled state): O(1), no re-indexing
unless a node's family or set of models changes.

Columns are numpy arrays when the table has more than :data:`SMALL_TABLE` rows, so a decision
is a few vector operations over them (see :mod:`~zmlcore.policy.context`); below that they are
plain lists and a decision scans the rows in Python, which costs less than the fixed overhead
of a dozen numpy calls. The upkeep code is the same for both (item assignment).

The router keeps one index over its views and passes it as ``nodes`` to
:func:`~zmlcore.policy.choose_node` (it is a ``Sequence[NodeView]``)::

    fleet = FleetIndex(views)            # once, and again when nodes are added or removed
    decision = choose_node(fleet, req, policy, now, state)   # reads the index, never writes it
    fleet.get(decision.node_id).outstanding += 1              # the index follows (O(1))

Passing a plain list works too: a throw-away index is built per call (O(n)).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from zmlcore.policy.estimate import (INF, MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, Coeffs, node_cost, node_overhead,
                                      node_slots, node_speeds)
from zmlcore.policy.types import NodeView

#: Tables with at most this many rows keep list columns and are scanned in Python (chosen by
#: measurement: benches/bench_decision.py --small, docs/benchmarks.md "Routing decision time").
SMALL_TABLE = 16


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
    def keys(self) -> Any:
        return self.table.key

    @property
    def drains(self) -> Any:
        return self.table.drain


class ModelTable:
    """Every node that serves (or is loading) one model: one row each, grouped by family in
    registration order (first node seen), nodes in registration order within a family.

    The float columns are numpy arrays, or lists when ``small`` (see the module docstring).
    """

    __slots__ = (
        "model", "small", "families", "family_chain", "by_family", "groups", "starts", "fam", "group_of", "chains", "flat", "views",
        "coeffs", "inputs", "up", "n_up", "n_up_version", "key", "drain", "pf", "inv_pf", "cost_cap", "depth", "maxc", "updated",
        "blocked", "health", "upd_lo", "blk_hi", "health_lo", "slot_rows", "slot_key", "base_rows",
    )

    def __init__(self, model: str, views: list[NodeView], families: list[str]) -> None:
        n = len(views)
        self.model = model
        self.views = views
        self.small = n <= SMALL_TABLE
        #: families as first written, in registration order (and as a chain: a policy's
        #: default, see context.Ctx)
        self.families = families
        self.family_chain = tuple(families)
        self.groups: list[FamilyGroup] = []
        self.by_family: dict[str, FamilyGroup] = {}
        #: first row of each group (every group has one)
        self.starts = np.zeros(0, dtype=np.intp)
        #: the group number (index in ``groups``) and the group of each row
        self.fam: list[int] = [0] * n
        self.group_of: list[FamilyGroup] = []
        #: per chain: the decision's view of it (context.Chain), a cache filled on first use
        self.chains: dict[tuple[str, ...], Any] = {}
        #: (group, row) in node registration order (round robin's cycle)
        self.flat: list[tuple[FamilyGroup, int]] = []
        self.coeffs: list[Coeffs | None] = [None] * n
        #: (pf, dec, maxc, cost) each row's Coeffs were computed from
        self.inputs: list[tuple[float, float, int, float, float, float, float] | None] = [None] * n
        #: status up and the model loaded (not only loading); how many rows are, per group
        self.up = [False] * n
        self.n_up: list[int] = []
        #: bumped whenever n_up changes (a chain caches its evaluation per version)
        self.n_up_version = 0

        def col(x: float) -> Any:
            return [x] * n if self.small else np.full(n, x)

        #: Coeffs.load_key / drain_key of the node's counters; INF while not routable
        #: (status not up, or the model only loading)
        self.key = col(INF)
        self.drain = col(INF)
        self.pf = col(1.0)
        self.inv_pf = col(1.0)
        #: $/h per req/s of capacity (Coeffs.cost_cap)
        self.cost_cap = col(0.0)
        #: effective outstanding requests (the strategies' queue depth)
        self.depth = col(0.0)
        #: sequence slots (Coeffs.maxc)
        self.maxc = col(1.0)
        #: state's updated_at; max(cooldown_until, saturated_until); health score
        self.updated = col(0.0)
        self.blocked = col(0.0)
        self.health = col(0.0)
        #: bounds on those columns' extremes, kept as they are written: no greater than the
        #: oldest ``updated`` and the lowest ``health``, no less than the latest ``blocked``.
        #: A decision reads the column itself only when a bound says a row may be stale,
        #: blocked or unhealthy (``oldest_update`` ... make the bound exact again).
        self.upd_lo = -INF
        self.blk_hi = INF
        self.health_lo = -INF
        #: a PrefixIndex's slot -> this table's row (-1: not here), and the (index, epoch) it
        #: was built for (zmlcore.policy.choose.cached_rows)
        self.slot_rows: Any = None
        self.slot_key: Any = None
        #: per (holders of a shared prefix, its tokens), the rows they fill (cached_rows)
        self.base_rows: dict[tuple[int, int], Any] = {}

    # The columns' exact extremes (large tables), each also made the column's bound.
    def oldest_update(self) -> float:
        u = self.updated
        lo: float = u.item(u.argmin())
        self.upd_lo = lo
        return lo

    def latest_block(self) -> float:
        b = self.blocked
        hi: float = b.item(b.argmax())
        self.blk_hi = hi
        return hi

    def lowest_health(self) -> float:
        h = self.health
        lo: float = h.item(h.argmin())
        self.health_lo = lo
        return lo


def _membership(v: NodeView) -> tuple[str, frozenset[str], list[str], list[str]]:
    st = v.state
    return st.family, frozenset(st.models).union(st.loading_models), st.models, st.loading_models


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
        #: (family, models + loading models, models, loading models) of each node when its
        #: tables were built
        self._member: dict[str, tuple[str, frozenset[str], list[str], list[str]]] = {}
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
    def _counts_changed(self, view: NodeView) -> None:
        """A counter changed (outstanding, pending, pending tokens): the rows' load keys."""
        for table, j in self._where.get(view._state.node_id, ()):
            _set_load(table, j, view)

    def _node_changed(self, view: NodeView, structural: bool) -> None:
        st = view._state
        where = self._where.get(st.node_id, ())
        if structural and self._tables:
            old = self._member.get(st.node_id)
            if old is None or old[0] != st.family or (
                (old[2] != st.models or old[3] != st.loading_models)  # as lists first: no sets to build
                and old[1] != frozenset(st.models).union(st.loading_models)
            ):
                # A node joins or leaves a model's table, or changes family: rebuild lazily.
                self._tables.clear()
                self._where.clear()
                self._member.clear()
                return
            for table, j in where:
                self._set_state(table, j, view)
            return
        for table, j in where:
            _set_counters(table, j, view)

    def _set_state(self, t: ModelTable, j: int, v: NodeView) -> None:
        st = v.state
        pf, dec, maxc = node_speeds(st, t.model)
        k, full = node_slots(st, t.model)
        inputs = (pf, dec, maxc, node_cost(st), node_overhead(st, t.model), k, full)
        if t.inputs[j] != inputs:
            t.inputs[j] = inputs
            c = t.coeffs[j] = Coeffs(pf, dec, maxc, inputs[3], self.mean_prompt, self.mean_output, inputs[4], k, full)
            t.pf[j] = c.pf
            t.inv_pf[j] = c.inv_pf
            t.cost_cap[j] = c.cost_cap
            t.maxc[j] = c.maxc
        # A prefill-only node serves no whole request (zmlcore.policy.split picks it for prefill legs).
        up = st.status == "up" and t.model in st.models and (not st.roles or "decode" in st.roles)
        if up != t.up[j]:
            t.up[j] = up
            t.n_up[t.fam[j]] += 1 if up else -1
            t.n_up_version += 1
        u, h = st.updated_at, st.health_score
        t.updated[j] = u
        t.health[j] = h
        if u < t.upd_lo:
            t.upd_lo = u
        if h < t.health_lo:
            t.health_lo = h
        _set_counters(t, j, v)

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
            t.n_up.append(0)
            t.by_family[fam.lower()] = g
            for j in range(start, start + len(members)):
                t.fam[j] = k
                t.group_of.append(g)
            start += len(members)
        for j, v in enumerate(ordered):
            row_of[v.node_id] = j
            self._set_state(t, j, v)
            self._where.setdefault(v.node_id, []).append((t, j))
        t.starts = np.array([g.start for g in t.groups], dtype=np.intp)
        for v in self._views:
            j = row_of.get(v.node_id, -1)
            if j >= 0:
                t.flat.append((t.group_of[j], j))
        return t

    def where(self, node_id: str, table: ModelTable) -> int | None:
        """The row of ``node_id`` in ``table`` (None if it does not serve the table's model)."""
        for t, j in self._where.get(node_id, ()):
            if t is table:
                return j
        return None


def _set_counters(t: ModelTable, j: int, v: NodeView) -> None:
    cool, sat = v._cooldown_until, v._saturated_until
    b = t.blocked[j] = cool if cool > sat else sat
    if b > t.blk_hi:
        t.blk_hi = b
    _set_load(t, j, v)


def _set_load(t: ModelTable, j: int, v: NodeView) -> None:
    """Row ``j``'s depth and keys from the view's counters (the effective counts, inline)."""
    out = v._outstanding + v._ext_out
    t.depth[j] = out
    c = t.coeffs[j]
    if t.up[j] and c is not None:
        pt = v._pending_tokens
        t.key[j] = c.load_key(out, v._pending + v._ext_pend,
                              None if pt is None else pt + v._ext_pend * c.mean_prompt)
        t.drain[j] = c.drain_key(out)
    else:
        t.key[j] = INF
        t.drain[j] = INF
