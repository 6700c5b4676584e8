"""One decision's working set: the candidate classes, per-request filters and helpers that the
strategies share. Internal to :mod:`zmlcore.policy`."""

from __future__ import annotations

from zmlcore.policy.estimate import DEFAULT_LATENCY_TARGET_S, INF
from zmlcore.policy.fleet import FleetIndex, ModelTable, NodeClass
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import FamilyEval, RouteRequest, RoutingState


class Cand:
    """The best node of one class for this request."""

    __slots__ = ("cls", "i", "est", "rank")

    def __init__(self, cls: NodeClass, i: int, est: float, rank: int) -> None:
        self.cls = cls
        self.i = i
        self.est = est
        #: position of the class's family in the evaluated chain (0 = first)
        self.rank = rank

    @property
    def depth(self) -> int:
        return self.cls.views[self.i].effective_outstanding()

    @property
    def cost_cap(self) -> float:
        return self.cls.coeffs.cost_cap


class Ctx:
    __slots__ = (
        "fleet", "table", "req", "policy", "now", "state", "stale_after", "prompt",
        "target_s", "families", "restore", "health_min", "evaluated",
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
        #: (family as written in the chain, its classes) in evaluation order
        self.families = [(f, table.by_family.get(f.lower(), [])) for f in chain]
        #: (class, index, key, drain) temporarily blocked for this request only
        self.restore: list[tuple[NodeClass, int, float, float]] = []
        self.evaluated: list[FamilyEval] | None = None

    # --- filters ---
    def check(self, cls: NodeClass, i: int) -> bool:
        """Time-dependent and per-request checks of a node at the top of a list; a failing
        node is blocked (for its cooldown, until its state changes, or for this request)."""
        v = cls.views[i]
        now = self.now
        if now - v.state.updated_at > self.stale_after:
            self.fleet.block(cls, i, INF)
            return False
        if v.cooldown_until > now:
            self.fleet.block(cls, i, v.cooldown_until)
            return False
        if v.saturated_until > now:
            self.fleet.block(cls, i, v.saturated_until)
            return False
        if self.health_min is not None and v.state.health_score < self.health_min:
            self.hide(cls, i)
            return False
        return True

    def hide(self, cls: NodeClass, i: int) -> None:
        self.restore.append((cls, i, cls.keys[i], cls.drains[i]))
        cls.set(i, INF, INF)

    def undo(self) -> None:
        for cls, i, k, d in reversed(self.restore):
            cls.keys[i] = k
            cls.drains[i] = d
            cls.best_k = cls.best_d = -1
        self.restore.clear()

    def hide_excluded(self) -> None:
        for nid in self.req.exclude:
            w = self.fleet.where(nid, self.table)
            if w is not None:
                self.hide(*w)

    # --- best of a class ---
    def best_key(self, cls: NodeClass) -> int | None:
        while True:
            i = cls.argmin_key()
            if i < 0:
                return None
            if self.check(cls, i):
                return i

    def best_drain(self, cls: NodeClass) -> int | None:
        while True:
            i = cls.argmin_drain()
            if i < 0:
                return None
            if self.check(cls, i):
                return i

    def candidates(self) -> list[Cand]:
        """Best node (by estimated TTFT) of every class of every family in the chain."""
        out: list[Cand] = []
        evaluated: list[FamilyEval] = []
        p = self.prompt
        counts = self.table.counts
        for rank, (fam, classes) in enumerate(self.families):
            n = 0
            for cls in classes:
                i = self.best_key(cls)
                if i is not None:
                    out.append(Cand(cls, i, cls.keys[i] + p * cls.coeffs.inv_pf, rank))
                    n += 1
            evaluated.append(
                FamilyEval(fam, counts.get(fam.lower(), 0), None if n else ("no_routable_node" if classes else "no_nodes"))
            )
        self.evaluated = evaluated
        return out

    def est(self, cls: NodeClass, i: int) -> float:
        return cls.keys[i] + self.prompt * cls.coeffs.inv_pf


def fastest(cands: list[Cand]) -> Cand | None:
    """Lowest estimated TTFT; ties go to the earlier family in the chain."""
    best = None
    for c in cands:
        if best is None or c.est < best.est or (c.est == best.est and c.rank < best.rank):
            best = c
    return best
