"""One decision's working set: which rows of the model's table may take this request, their
estimates, and the candidates the strategies choose among. Internal to :mod:`zmlcore.policy`.

Reads the :class:`~zmlcore.policy.FleetIndex`, never writes it. Rows whose status or model rule
them out have an INF load key in the index; the time-dependent and per-request checks
(staleness, cooldown, saturation, health threshold, excluded nodes, families outside the chain)
are a boolean mask computed per decision, from the index's copies of the fields
``is_routable`` reads.

Candidates. Every node is its own candidate, but handing the strategies 1,000 of them would
cost more than the decision budget, so :meth:`Ctx.candidates` drops nodes that cannot win under
any strategy: node ``x`` is dropped when some node ``y`` comes before it in (estimate, chain
rank, row) order and is strictly cheaper per unit of capacity (and, when the policy has a
``queue_threshold``, passes it whenever ``x`` does). Every strategy prefers a lower estimate,
then a lower cost (lexicographically or by a weighted sum with weights >= 0), with ties going to
the earlier chain rank, then the earlier node: ``y`` wins wherever ``x`` would, and ``y`` also
keeps the cheapest cost of any estimate-bounded set it belongs to. Nodes exactly as cheap as
the cheapest one but slower are dropped too unless the score ignores the estimate (a weighted
policy without latency weight), where rank may decide between them. What remains is that
(estimate, cost) front (plus each family's fastest node for a chain walk, which takes each
family's best in turn);
tests/unit/test_policy_index.py checks the picks against a scan of every node. (A weighted sum
can tie two nodes whose estimates and costs differ by a few ulps; ignored.)
"""

from __future__ import annotations

import numpy as np

from zmlcore.policy.estimate import DEFAULT_LATENCY_TARGET_S, INF
from zmlcore.policy.fleet import FamilyGroup, FleetIndex, ModelTable
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import FamilyEval, RouteRequest, RoutingState


class Cand:
    """One candidate node (row ``i`` of the table behind ``cls``) for this request."""

    __slots__ = ("cls", "i", "est", "rank", "cost_cap")

    def __init__(self, cls: FamilyGroup, i: int, est: float, rank: int, cost_cap: float | None = None) -> None:
        self.cls = cls
        self.i = i
        self.est = est
        #: position of the node's family in the evaluated chain (0 = first)
        self.rank = rank
        #: $/h per req/s of capacity (Coeffs.cost_cap)
        self.cost_cap = float(cls.table.cost_cap[i]) if cost_cap is None else cost_cap

    @property
    def depth(self) -> int:
        return self.cls.views[self.i].effective_outstanding()

    @property
    def pf(self) -> float:
        """The node's prefill speed (tokens/s, Coeffs.pf)."""
        return float(self.cls.table.pf[self.i])


class Ctx:
    __slots__ = (
        "fleet", "table", "req", "policy", "now", "state", "stale_after", "prompt", "target_s",
        "families", "health_min", "evaluated", "ranks", "rank_arr", "counts", "strategy", "_outside", "_bad", "_est", "_drain", "_cost",
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
    ) -> None:
        self.fleet = fleet
        self.table = table
        self.req = req
        self.policy = policy
        self.now = now
        self.state = state
        self.stale_after = stale_after
        self.prompt = float(req.prompt_tokens) if req.prompt_tokens > 0 else fleet.mean_prompt
        cfg = policy.config
        self.target_s = cfg.latency_target_ms / 1000.0 if cfg.latency_target_ms else DEFAULT_LATENCY_TARGET_S
        self.health_min = cfg.health_threshold
        chain = policy.chain or tuple(table.families)
        cached = table.chains.get(chain)
        if cached is None:
            first: dict[str, int] = {}
            for r, f in enumerate(chain):
                first.setdefault(f.lower(), r)
            ranks = [first.get(f.lower(), -1) for f in table.families] or [0]
            families = [(f, table.by_family.get(f.lower(), [])) for f in chain]
            cached = table.chains[chain] = (
                families, ranks, np.array(ranks), [table.counts.get(f.lower(), 0) for f in chain],
            )
        #: (family as written in the chain, its group) in evaluation order; the chain rank of
        #: each of the table's families (-1: not in the chain); nodes per chain family
        self.families, self.ranks, self.rank_arr, self.counts = cached
        self.strategy = policy.strategy
        self._outside = min(self.ranks) < 0
        self.evaluated: list[FamilyEval] | None = None
        self._bad: np.ndarray | bool | None = None
        self._est: np.ndarray | None = None
        self._drain: np.ndarray | None = None
        self._cost: np.ndarray | None = None

    # --- per-request views of the table ---
    def ok(self, i: int) -> bool:
        """The time-dependent and policy checks of one row (``is_routable``'s, bar status/model)."""
        v = self.table.views[i]
        now = self.now
        st = v.state
        return not (
            now - st.updated_at > self.stale_after or v.cooldown_until > now or v.saturated_until > now
            or (self.health_min is not None and st.health_score < self.health_min)
        )

    def bad(self) -> np.ndarray | None:
        """Rows that fail :meth:`ok` (from the index's copies of the same fields), are excluded
        or outside the chain; None when there are none (the usual case: no row to hide)."""
        cached = self._bad
        if cached is not None:
            return None if cached is False else cached  # type: ignore[return-value]
        t = self.table
        now = self.now
        hmin = self.health_min
        b: np.ndarray | None = None
        # One reduction per check first: usually no row is stale, cooling down or unhealthy.
        # (``now - u`` is monotone in ``u``, so the oldest row decides staleness exactly.)
        if (
            now - t.updated.min() > self.stale_after or t.blocked.max() > now
            or (hmin is not None and t.health.min() < hmin)
        ):
            m = (now - t.updated) > self.stale_after
            m |= t.blocked > now
            if hmin is not None:
                m |= t.health < hmin
            b = m if m.any() else None
        if self._outside:
            out = (self.rank_arr < 0)[t.fam]
            b = out if b is None else b | out
        for nid in self.req.exclude:
            j = self.fleet.where(nid, t)
            if j is not None:
                if b is None:
                    b = np.zeros(len(t.views), dtype=bool)
                b[j] = True
        self._bad = False if b is None else b
        return b

    def _hide(self, a: np.ndarray) -> np.ndarray:
        """``a`` (a fresh array) with INF where the row may not take this request."""
        b = self.bad()
        if b is not None:
            a[b] = INF
        return a

    def estimates(self) -> np.ndarray:
        """Estimated TTFT of every row for this request; INF where the row may not take it."""
        e = self._est
        if e is None:
            t = self.table
            e = self._est = self._hide(t.key + self.prompt * t.inv_pf)
        return e

    def check(self, cls: FamilyGroup, i: int) -> bool:
        """May row ``i`` (whose load key is finite) take this request now?"""
        return bool(self.estimates()[i] != INF)

    def est(self, cls: FamilyGroup, i: int) -> float:
        t = self.table
        return float(t.key.item(i)) + self.prompt * float(t.inv_pf.item(i))

    def best_drain(self, cls: FamilyGroup) -> int | None:
        """The group's row with the smallest drain key that may take the request (first wins)."""
        s, e = cls.start, cls.stop
        d = self._drain
        if d is None:
            d = self._drain = self._hide(self.table.drain.copy())
        i = s + int(d[s:e].argmin())
        return None if d[i] == INF else i

    # --- candidates ---
    def candidates(self) -> list[Cand]:
        """Every node that can win (see the module docstring), in (chain rank, row) order."""
        t = self.table
        r = sorted(self._rows())
        p = self.prompt
        group_of, ranks = t.group_of, self.ranks
        out = [
            Cand(group_of[i], i, k + p * f, ranks[fam], c)
            for i, k, f, fam, c in zip(r, t.key[r].tolist(), t.inv_pf[r].tolist(), t.fam[r].tolist(),
                                       t.cost_cap[r].tolist())
        ]
        out.sort(key=_by_rank)
        return out

    def _rows(self) -> set[int]:
        est = self.estimates()
        t = self.table
        rows: set[int] = set()
        evaluated: list[FamilyEval] = []
        ranks = self.ranks
        best = np.minimum.reduceat(est, t.starts).tolist()  # each family's fastest estimate
        walks = self.policy.config.cost_priority == "latency"  # a chain walk takes each family's best
        first: tuple[float, int, int] | None = None  # (estimate, rank, family) of the fastest node
        for (fam, groups), count in zip(self.families, self.counts):
            n = 0
            for g in groups:
                e = best[g.k]
                if e != INF:
                    n += 1
                    if walks:
                        rows.add(g.start + int(est[g.start:g.stop].argmin()))
                    here = (e, ranks[g.k], g.k)
                    if first is None or here < first:
                        first = here
            evaluated.append(
                FamilyEval(fam, count, None if n else ("no_routable_node" if groups else "no_nodes"))
            )
        self.evaluated = evaluated
        if first is None:
            return rows
        g = t.groups[first[2]]
        f = g.start + int(est[g.start:g.stop].argmin())
        rows.add(f)
        if self.strategy == "latency":
            rows.update(self._slowest_near(est, first[0]))
        cfg = self.policy.config
        weighted = self.strategy == "weighted"
        if weighted and not cfg.latency_weight and not cfg.cost_weight:
            # Every score is 0 and list order decides: no node may be dropped.
            rows.update(np.flatnonzero(est != INF).tolist())
            return rows
        cost = self._cost
        if cost is None:
            cost = self._cost = self._hide(t.cost_ok.copy()) if self.bad() is not None else t.cost_ok
        # With no latency weight, equally cheap but slower nodes tie on score (rank decides).
        rows.update(self._front(est, cost, f, weighted and not cfg.latency_weight))
        qt = cfg.queue_threshold
        if qt is not None:
            over = t.depth > qt
            rows.update(self._front(np.where(over, INF, est), np.where(over, INF, cost), None, True))
        return rows

    def _slowest_near(self, est: np.ndarray, e0: float) -> list[int]:
        """``latency``'s near-tie winner: of the rows within ``TIE_S`` of the fastest estimate
        (while that is under ``TIE_BELOW_S``), the slowest prefill, then estimate, rank, row."""
        from zmlcore.policy.strategies import latency

        tie, below = getattr(latency, "TIE_S", 0.0), getattr(latency, "TIE_BELOW_S", 0.0)
        if tie <= 0.0 or e0 > below:
            return []
        pf = np.where(est <= e0 + tie, self.table.pf, INF)
        rows = np.flatnonzero(pf == pf.min()).tolist()
        fam, ranks = self.table.fam, self.ranks
        return [min(rows, key=lambda i: (est.item(i), ranks[fam.item(i)], i))]

    def _front(self, est: np.ndarray, cost: np.ndarray, f: int | None, ties: bool) -> list[int]:
        """Rows that may win on (estimate, cost) (see the module docstring); INF rows excluded.

        ``f`` is the first row in (estimate, rank, row) order if known: then nodes as fast but
        dearer are behind it and need no test. ``ties`` keeps nodes as cheap as the cheapest but
        slower (only a score that ignores the estimate can prefer them).
        """
        z = int(cost.argmin())
        cmin = cost.item(z)
        if cmin == INF:
            return []
        # Bounds first: slower than the cheapest node or dearer than the fastest loses to it.
        ez = est.item(z)
        if f is None:
            f = int(est.argmin())
            keep = (cost <= cost.item(f)) | (est == est.item(f))
            keep &= (est <= ez) | (cost == cmin) if ties else est <= ez
        elif ties:
            keep = (est <= ez) | (cost == cmin)
            keep &= cost <= cost.item(f)
        else:
            keep = est <= ez
            keep &= cost <= cost.item(f)
        s = np.flatnonzero(keep)
        k = len(s)
        if k <= 1:
            return [int(i) for i in s]
        fam = self.table.fam
        if k <= 16:  # few survivors: plain Python beats a dozen small numpy calls
            rows = s.tolist()
            ranks = self.ranks
            key = [(e, ranks[r], i, c) for e, r, i, c in zip(est[s].tolist(), fam[s].tolist(), rows, cost[s].tolist())]
            key.sort()
            out = []
            low = INF
            for _e, _r, i, c in key:
                if c <= low:
                    out.append(i)
                    low = c
            return out
        # Exact front of the survivors: in (estimate, rank, row) order, keep a row unless an
        # earlier one is strictly cheaper (lexsort is stable and ``s`` ascending: row breaks ties).
        order = np.lexsort((self.rank_arr[fam[s]], est[s]))
        cs = cost[s][order]
        before = np.minimum.accumulate(np.concatenate(([INF], cs[:-1])))
        front: list[int] = s[order[cs <= before]].tolist()
        return front


def _by_rank(c: Cand) -> int:
    return c.rank


def fastest(cands: list[Cand]) -> Cand | None:
    """Lowest estimated TTFT; ties go to the earlier family in the chain."""
    best = None
    for c in cands:
        if best is None or c.est < best.est or (c.est == best.est and c.rank < best.rank):
            best = c
    return best
