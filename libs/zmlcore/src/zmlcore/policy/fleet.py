"""FleetIndex: a per-model candidate index that keeps routing O(classes), not O(nodes).

Nodes of one family with the same speeds (2% buckets), slots and price form a *class*. Inside a
class the estimated TTFT of every node is ``load_key + P / pf`` with the same ``pf``, so the best
node is the one with the smallest load key: one C-level ``min()`` over a list of floats. The
index keeps those lists exact because every :class:`NodeView` assignment (``outstanding``,
``pending``, ``cooldown_until``, ``saturated_until``, ``state``) notifies it.

The router builds one index over its views and passes it as ``nodes`` to
:func:`~zmlcore.policy.choose_node` (it is a ``Sequence[NodeView]``)::

    fleet = FleetIndex(views)            # once, and again when nodes are added or removed
    decision = choose_node(fleet, req, policy, now, state)
    fleet.get(decision.node_id).outstanding += 1   # the index follows

A polled state that changes a node's models, family, speeds or price re-indexes lazily (next
decision). Passing a plain list works too: a throw-away index is built per call (O(n)).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import overload

from zmlcore.policy.estimate import INF, MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, Coeffs, bucket, node_cost, node_speeds
from zmlcore.policy.types import NodeView


class NodeClass:
    """Nodes of one family and profile serving one model, with their current keys.

    ``best_k`` / ``best_d`` cache the first index of the minimum of ``keys`` / ``drains``
    (-1: unknown). Updates keep them exact in O(1) except when the best node's key rises (the
    usual case right after it was chosen), which leaves them unknown until the next decision.
    """

    __slots__ = ("family", "coeffs", "views", "ok", "keys", "drains", "best_k", "best_d")

    def __init__(self, family: str, coeffs: Coeffs) -> None:
        self.family = family
        self.coeffs = coeffs
        self.views: list[NodeView] = []
        #: status up and model loaded (time-independent routability)
        self.ok: list[bool] = []
        #: Coeffs.load_key of each node, INF when not routable
        self.keys: list[float] = []
        #: Coeffs.drain_key of each node, INF when not routable
        self.drains: list[float] = []
        self.best_k = -1
        self.best_d = -1

    def refresh(self, i: int) -> None:
        if self.ok[i]:
            v = self.views[i]
            out = v.effective_outstanding()
            c = self.coeffs
            self.set(i, c.load_key(out, v.effective_pending()), (out + 1) / c.mu)
        else:
            self.set(i, INF, INF)

    def set(self, i: int, key: float, drain: float) -> None:
        keys = self.keys
        b = self.best_k
        if b >= 0:
            if i == b:
                if key > keys[i]:
                    self.best_k = -1
            elif key < keys[b] or (key == keys[b] and i < b):
                self.best_k = i
        keys[i] = key
        drains = self.drains
        b = self.best_d
        if b >= 0:
            if i == b:
                if drain > drains[i]:
                    self.best_d = -1
            elif drain < drains[b] or (drain == drains[b] and i < b):
                self.best_d = i
        drains[i] = drain

    def argmin_key(self) -> int:
        """First index of the smallest key (-1 if every key is INF)."""
        b = self.best_k
        if b < 0:
            keys = self.keys
            m = min(keys)
            b = self.best_k = keys.index(m)
        return -1 if self.keys[b] == INF else b

    def argmin_drain(self) -> int:
        b = self.best_d
        if b < 0:
            drains = self.drains
            m = min(drains)
            b = self.best_d = drains.index(m)
        return -1 if self.drains[b] == INF else b


class ModelTable:
    """Every node that serves (or is loading) one model, by family and class."""

    __slots__ = ("model", "families", "by_family", "counts", "flat", "n_loaded")

    def __init__(self, model: str) -> None:
        self.model = model
        #: families in registration order (first node seen)
        self.families: list[str] = []
        self.by_family: dict[str, list[NodeClass]] = {}
        self.counts: dict[str, int] = {}
        self.flat: list[tuple[NodeClass, int]] = []
        self.n_loaded = 0


def _signature(v: NodeView) -> tuple[object, ...]:
    st = v.state
    pf, dec, maxc = node_speeds(st)
    return (
        st.family, st.accelerator_type, tuple(st.models), tuple(st.loading_models),
        bucket(pf), bucket(dec), maxc, round(node_cost(st), 4),
    )


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
        self._where: dict[str, list[tuple[ModelTable, NodeClass, int]]] = {}
        self._sig: dict[str, tuple[object, ...]] = {}
        #: (release time, seq, class, index): nodes kept out of the lists until then
        self._blocked: list[tuple[float, int, NodeClass, int]] = []
        self._seq = 0
        self._watching = watch
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

    # --- index maintenance ---
    def _node_changed(self, view: NodeView, structural: bool) -> None:
        if structural and self._tables:
            sig = _signature(view)
            if self._sig.get(view.node_id) != sig:
                self._sig[view.node_id] = sig
                self._invalidate()
                return
            for table, cls, i in self._where.get(view.node_id, ()):
                st = view.state
                cls.ok[i] = st.status == "up" and table.model in st.models
        for _table, cls, i in self._where.get(view.node_id, ()):
            cls.refresh(i)

    def _invalidate(self) -> None:
        self._tables.clear()
        self._where.clear()
        self._blocked.clear()

    def table(self, model: str) -> ModelTable:
        t = self._tables.get(model)
        if t is None:
            t = self._build(model)
            self._tables[model] = t
        return t

    def _build(self, model: str) -> ModelTable:
        t = ModelTable(model)
        classes: dict[tuple[object, ...], NodeClass] = {}
        for v in self._views:
            st = v.state
            if model not in st.models and model not in st.loading_models:
                continue
            sig = _signature(v)
            self._sig[v.node_id] = sig
            fam = st.family
            key = sig[:1] + sig[4:]
            cls = classes.get(key)
            if cls is None:
                pf, dec, maxc = node_speeds(st)
                cls = NodeClass(fam, Coeffs(pf, dec, maxc, node_cost(st), self.mean_prompt, self.mean_output))
                classes[key] = cls
                fl = fam.lower()
                if fl not in t.by_family:
                    t.families.append(fam)
                    t.by_family[fl] = []
                    t.counts[fl] = 0
                t.by_family[fl].append(cls)
            i = len(cls.views)
            cls.views.append(v)
            ok = st.status == "up" and model in st.models
            cls.ok.append(ok)
            cls.keys.append(INF)
            cls.drains.append(INF)
            cls.best_k = cls.best_d = -1
            cls.refresh(i)
            t.counts[fam.lower()] += 1
            t.flat.append((cls, i))
            t.n_loaded += model in st.models
            self._where.setdefault(v.node_id, []).append((t, cls, i))
        return t

    def block(self, cls: NodeClass, i: int, until: float) -> None:
        """Keep node ``i`` of ``cls`` out of the lists until ``until`` (INF: until it changes)."""
        cls.set(i, INF, INF)
        if until != INF:
            self._seq += 1
            heapq.heappush(self._blocked, (until, self._seq, cls, i))

    def release(self, now: float) -> None:
        """Put back nodes whose cooldown or saturation has ended."""
        b = self._blocked
        while b and b[0][0] <= now:
            _, _, cls, i = heapq.heappop(b)
            cls.refresh(i)

    def where(self, node_id: str, table: ModelTable) -> tuple[NodeClass, int] | None:
        for t, cls, i in self._where.get(node_id, ()):
            if t is table:
                return cls, i
        return None
