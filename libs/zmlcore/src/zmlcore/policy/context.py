"""One decision's view of a model's table: which rows may take this request, their estimates,
and the two ways the strategies read them. Internal to :mod:`zmlcore.policy`.

Reads the :class:`~zmlcore.policy.FleetIndex` and never changes what it says (it caches a chain's
ranks over a table, :class:`Chain`). Rows whose status or model rule
them out have an INF load key in the index; the time-dependent and per-request checks
(staleness, cooldown, saturation, health threshold, excluded nodes, families outside the chain)
are made per decision from the index's copies of the fields ``is_routable`` reads.

* :class:`Ctx` (tables of up to ``SMALL_TABLE`` rows): :meth:`Ctx.candidates` hands the
  strategy every row that may take the request as a :class:`Cand`, in (chain rank, row) order,
  and the strategy's ``select`` picks among them. ``select`` is each strategy's definition.
* :class:`VCtx` (larger tables): the strategy's ``select_rows`` computes the same pick with a
  few numpy operations over the columns (:meth:`VCtx.estimates`, :meth:`VCtx.first`), with
  no per-node Python. Floats are computed in the same order as ``select`` computes them, so
  the picks are identical, ties included: tests/unit/test_policy_index.py checks both paths
  against ``select`` over a scan of every node.

Ties: every strategy keeps the first best candidate in (chain rank, row) order, which is what
``argmin`` over the rows returns when the rows' ranks never decrease (the table keeps families
in registration order, so: no chain, or one in registration order); otherwise
:meth:`VCtx.first` breaks ties by rank explicitly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zmlcore.policy.estimate import DEFAULT_LATENCY_TARGET_S, INF
from zmlcore.policy.fleet import FamilyGroup, FleetIndex, ModelTable
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import FamilyEval, RouteRequest, RoutingState

#: Chains cached per table (a chain's ranks over the table's families).
MAX_CHAINS = 64


class Cand:
    """One candidate node (row ``i`` of the table behind ``cls``) for this request."""

    __slots__ = ("cls", "i", "est", "rank", "cost_cap", "cached")

    def __init__(self, cls: FamilyGroup, i: int, est: float, rank: int, cost_cap: float | None = None,
                 cached: int = 0) -> None:
        self.cls = cls
        self.i = i
        self.est = est
        #: position of the node's family in the evaluated chain (0 = first)
        self.rank = rank
        #: $/h per req/s of capacity (Coeffs.cost_cap)
        self.cost_cap = float(cls.table.cost_cap[i]) if cost_cap is None else cost_cap
        #: prompt tokens the node holds in its prefix cache (estimated)
        self.cached = cached

    @property
    def depth(self) -> int:
        return self.cls.views[self.i].effective_outstanding()

    @property
    def pf(self) -> float:
        """The node's prefill speed (tokens/s, Coeffs.pf)."""
        return float(self.cls.table.pf[self.i])

    @property
    def slot_use(self) -> float:
        """The node's queue depth over its sequence slots (1.0: every slot taken)."""
        t = self.cls.table
        return float(t.depth[self.i]) / float(t.maxc[self.i])


class Chain:
    """A policy's chain as it falls on one table (cached in ``ModelTable.chains``)."""

    __slots__ = ("families", "first", "counts", "ranks", "outside", "monotone", "outside_rows", "evaluation")

    def __init__(self, table: ModelTable, chain: tuple[str, ...]) -> None:
        first: dict[str, int] = {}
        for r, f in enumerate(chain):
            first.setdefault(f.lower(), r)
        #: (family as written, its group or None) in chain order
        self.families = [(f, table.by_family.get(f.lower())) for f in chain]
        #: whether each chain position is its family's first (a repeat evaluates nothing)
        self.first = [first[f.lower()] == r for r, f in enumerate(chain)]
        #: nodes per chain position
        self.counts = [g.stop - g.start if g is not None else 0 for _f, g in self.families]
        #: chain rank of each of the table's groups (-1: not in the chain)
        self.ranks = [first.get(f.lower(), -1) for f in table.families]
        self.outside = min(self.ranks, default=0) < 0
        inside = [r for r in self.ranks if r >= 0]
        #: the rows' ranks never decrease: argmin's first row is the first in (rank, row) order
        self.monotone = all(a <= b for a, b in zip(inside, inside[1:]))
        self.outside_rows: np.ndarray | None = None
        #: (table.n_up_version, per chain position its FamilyEval) when no row is ruled out by
        #: the per-decision checks: what VCtx.evaluate reports then (shared by the decisions:
        #: a strategy replaces an entry of its own copy of the list, never changes one)
        self.evaluation: tuple[int, list[FamilyEval]] | None = None
        if self.outside and not table.small:
            self.outside_rows = np.array([self.ranks[k] < 0 for k in table.fam], dtype=bool)


class Ctx:
    """The decision over a small table: plain Python over the rows (see the module docstring)."""

    __slots__ = (
        "fleet", "table", "req", "policy", "now", "state", "stale_after", "prompt", "target_s", "health_min",
        "families", "first_of", "ranks", "counts", "chain", "evaluated", "cached", "warm_rows", "_bad", "_est",
    )

    def __init__(
        self,
        fleet: FleetIndex,
        table: ModelTable,
        req: RouteRequest,
        policy: ResolvedPolicy,
        now: float,
        state: RoutingState,
        stale_after: float,
        cached: Any = None,
    ) -> None:
        self.fleet = fleet
        self.table = table
        #: prompt tokens each row holds in its prefix cache: {row: tokens} (small tables), a
        #: dense array (large ones), or None (no cache lookup, or nothing held)
        self.cached = cached
        #: the rows with cached tokens, when cached_rows listed them (a few warm nodes); None
        #: or [-1]: read ``cached`` itself
        self.warm_rows: list[int] | None = None
        self.req = req
        self.policy = policy
        self.now = now
        self.state = state
        self.stale_after = stale_after
        self.prompt = float(req.prompt_tokens) if req.prompt_tokens > 0 else fleet.mean_prompt
        cfg = policy.config
        self.target_s = cfg.latency_target_ms / 1000.0 if cfg.latency_target_ms else DEFAULT_LATENCY_TARGET_S
        self.health_min = cfg.health_threshold
        key = policy.chain or table.family_chain
        chain: Chain | None = table.chains.get(key)
        if chain is None:
            if len(table.chains) >= MAX_CHAINS:  # inline policies can name many chains: stay bounded
                table.chains.clear()
            chain = table.chains[key] = Chain(table, key)
        self.chain: Chain = chain
        #: (family as written in the chain, its group or None) in evaluation order; whether
        #: each is its family's first occurrence; the chain rank of each of the table's
        #: groups (-1: not in the chain); nodes per chain position
        self.families = chain.families
        self.first_of = chain.first
        self.ranks = chain.ranks
        self.counts = chain.counts
        #: per chain position, set by candidates() (a strategy may add a rejection reason, by
        #: replacing the entry: see Chain.evaluation)
        self.evaluated: list[FamilyEval] | None = None
        #: VCtx's per-decision caches (set here: one __init__ call per decision, not two)
        self._bad: np.ndarray | bool | None = None
        self._est: np.ndarray | None = None

    def ok(self, i: int) -> bool:
        """The time-dependent and per-request checks of row ``i`` (``is_routable``'s, bar
        status/model, which make the load key INF), the policy's health threshold and exclude."""
        t = self.table
        now = self.now
        hmin = self.health_min
        return not (
            now - t.updated[i] > self.stale_after or t.blocked[i] > now
            or (hmin is not None and t.health[i] < hmin)
            or (self.req.exclude and t.views[i].node_id in self.req.exclude)
        )

    def check(self, cls: FamilyGroup, i: int) -> bool:
        """May row ``i`` (whose load key is finite, of a family in the chain) take the request?"""
        return self.ok(i)

    def cached_at(self, i: int) -> int:
        c = self.cached
        return int(c.get(i, 0)) if c else 0

    def est(self, cls: FamilyGroup, i: int) -> float:
        t = self.table
        c = self.cached
        if c and i in c:
            return float(t.key[i]) + (self.prompt - float(c[i])) * float(t.inv_pf[i])
        return float(t.key[i]) + self.prompt * float(t.inv_pf[i])

    def best_drain(self, cls: FamilyGroup) -> int | None:
        """The group's row with the smallest drain key that may take the request (first wins)."""
        d = self.table.drain
        best = None
        for i in range(cls.start, cls.stop):
            if d[i] != INF and (best is None or d[i] < d[best]) and self.ok(i):
                best = i
        return best

    def candidates(self) -> list[Cand]:
        """Every row that may take the request, in (chain rank, row) order; sets ``evaluated``."""
        t = self.table
        key, inv_pf, cost = t.key, t.inv_pf, t.cost_cap
        updated, blocked, health, views = t.updated, t.blocked, t.health, t.views
        p, now, stale, hmin, excl = self.prompt, self.now, self.stale_after, self.health_min, self.req.exclude
        cached = self.cached or {}
        out: list[Cand] = []
        evaluated: list[FamilyEval] = []
        first_of, counts = self.first_of, self.counts
        for rank, (fam, g) in enumerate(self.families):
            n = 0
            if g is not None and first_of[rank]:
                for i in range(g.start, g.stop):
                    k = key[i]
                    if (
                        k == INF or now - updated[i] > stale or blocked[i] > now
                        or (hmin is not None and health[i] < hmin) or (excl and views[i].node_id in excl)
                    ):
                        continue
                    c = cached.get(i, 0) if cached else 0
                    out.append(Cand(g, i, k + (p - c) * inv_pf[i] if c else k + p * inv_pf[i], rank, cost[i], c))
                    n += 1
            evaluated.append(
                FamilyEval(fam, counts[rank], None if n else ("no_routable_node" if g is not None else "no_nodes"))
            )
        self.evaluated = evaluated
        return out


class VCtx(Ctx):
    """The decision over a large table: vector operations over its columns."""

    __slots__ = ()

    def bad(self) -> np.ndarray | None:
        """Rows that fail :meth:`ok` or lie outside the chain; None when there are none (the
        usual case: no row to hide)."""
        cached = self._bad
        if cached is not None:
            return None if cached is False else cached  # type: ignore[return-value]
        t = self.table
        now = self.now
        hmin = self.health_min
        b: np.ndarray | None = None
        # Usually no row is stale, cooling down or unhealthy: the table's bounds on the
        # columns' extremes say so without reading them, else the extremes themselves do.
        # (``now - u`` is monotone in ``u``, so the oldest row decides staleness exactly.)
        stale = self.stale_after
        if (
            (now - t.upd_lo > stale and now - t.oldest_update() > stale)
            or (t.blk_hi > now and t.latest_block() > now)
            or (hmin is not None and t.health_lo < hmin and t.lowest_health() < hmin)
        ):
            m = (now - t.updated) > stale
            m |= t.blocked > now
            if hmin is not None:
                m |= t.health < hmin
            b = m if np.count_nonzero(m) else None
        out = self.chain.outside_rows
        if out is not None:
            b = out if b is None else b | out
        for nid in self.req.exclude:
            j = self.fleet.where(nid, t)
            if j is not None:
                b = np.zeros(len(t.views), dtype=bool) if b is None else b.copy() if b is out else b
                b[j] = True
        self._bad = False if b is None else b
        return b

    def ok(self, i: int) -> bool:
        b = self.bad()
        return b is None or not b[i]

    def cached_at(self, i: int) -> int:
        c = self.cached
        return 0 if c is None else int(c.item(i))

    def est(self, cls: FamilyGroup, i: int) -> float:
        t = self.table
        c = self.cached
        if c is not None and c.item(i):
            return float(t.key.item(i)) + (self.prompt - float(c.item(i))) * float(t.inv_pf.item(i))
        return float(t.key.item(i)) + self.prompt * float(t.inv_pf.item(i))

    def estimates(self) -> np.ndarray:
        """Estimated TTFT of every row for this request; INF where the row may not take it."""
        e = self._est
        if e is None:
            t = self.table
            c = self.cached
            # key + (P - c) * inv_pf, in one array (a + b is b + a, bit for bit)
            if c is None:
                e = np.multiply(t.inv_pf, self.prompt)
            else:
                e = np.subtract(self.prompt, c)
                e *= t.inv_pf
            e += t.key
            self._est = e
            b = self.bad()
            if b is not None:
                e[b] = INF
        return e

    def drains(self) -> np.ndarray:
        """Every row's drain key; INF where the row may not take the request."""
        d = self.table.drain
        b = self.bad()
        return d if b is None else np.where(b, INF, d)

    def first(self, a: np.ndarray) -> int | None:
        """The row with the smallest value in ``a`` (INF: none), ties to the lowest (rank, row)."""
        i = int(a.argmin())
        v = a.item(i)
        if v == INF:
            return None
        if not self.chain.monotone:
            tied = (a == v).nonzero()[0]
            if len(tied) > 1:
                ranks, fam = self.ranks, self.table.fam
                i = min(tied.tolist(), key=lambda r: (ranks[fam[r]], r))
        return i

    def first_in(self, rows: np.ndarray, vals: np.ndarray) -> int | None:
        """Of ``rows`` (ascending), the one whose value in ``vals`` (aligned with ``rows``) is
        the smallest, ties to the lowest (rank, row); None if there is none or it is INF. The
        same row :meth:`first` finds in an array that is INF outside ``rows``."""
        if not len(rows):
            return None
        k = int(vals.argmin())
        v = vals.item(k)
        if v == INF:
            return None
        if not self.chain.monotone:
            tied = rows[vals == v]
            if len(tied) > 1:
                ranks, fam = self.ranks, self.table.fam
                return int(min(tied.tolist(), key=lambda r: (ranks[fam[r]], r)))
        return int(rows[k])

    def first_of_rows(self, rows: np.ndarray, a: np.ndarray) -> int:
        """Of ``rows`` (ascending, non-empty), the one with the smallest ``a``, ties to the
        lowest (rank, row)."""
        if len(rows) == 1:
            return int(rows[0])
        sub = a[rows]
        tied = rows[sub == sub.item(sub.argmin())]
        if len(tied) == 1 or self.chain.monotone:
            return int(tied[0])
        ranks, fam = self.ranks, self.table.fam
        return int(min(tied.tolist(), key=lambda r: (ranks[fam[r]], r)))

    def row_est(self, i: int) -> float:
        """Row ``i``'s estimate: from :meth:`estimates` when computed (it computes each row as
        :meth:`est` does, operation by operation: the same float)."""
        e = self._est
        if e is not None:
            x: float = e.item(i)
            if x != INF:
                return x
        return self.est(self.table.group_of[i], i)

    def cand(self, i: int) -> Cand:
        g = self.table.group_of[i]
        return Cand(g, i, self.row_est(i), self.ranks[g.k], cached=self.cached_at(i))

    def evaluate(self) -> None:
        """``evaluated`` as :meth:`Ctx.candidates` sets it."""
        t = self.table
        usual = self.bad() is None
        if usual:
            cached = self.chain.evaluation
            if cached is not None and cached[0] == t.n_up_version:
                self.evaluated = cached[1].copy()  # the entries shared: ~1.5 us of dataclass inits saved
                return
            live = t.n_up
        else:
            live = (np.minimum.reduceat(self.estimates(), t.starts) != INF).tolist()
        first_of, counts = self.first_of, self.counts
        rows = [
            FamilyEval(fam, counts[r], None if g is not None and first_of[r] and live[g.k]
                       else ("no_routable_node" if g is not None else "no_nodes"))
            for r, (fam, g) in enumerate(self.families)
        ]
        if usual:
            self.chain.evaluation = (t.n_up_version, rows)
            rows = rows.copy()
        self.evaluated = rows


def fastest(cands: list[Cand]) -> Cand | None:
    """Lowest estimated TTFT; ties go to the earlier family in the chain."""
    best = None
    for c in cands:
        if best is None or c.est < best.est or (c.est == best.est and c.rank < best.rank):
            best = c
    return best
