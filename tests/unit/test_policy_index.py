"""The FleetIndex picks what a scan over every node picks, on fleets whose per-node speeds drift.

The reference below scores each node on its own with the pure functions (``is_routable``,
``Coeffs``) and hands *every* routable node to the same strategy code; the index keeps numpy
rows and prunes candidates (zmlcore/policy/context.py). Both must name the same node, estimate
and per-family evaluation, decision after decision, while polls change speeds, statuses and
queues and the router's counters move.
"""

from __future__ import annotations

import random
import zlib
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from test_policy_helpers import NOW, fleet5, node

from zmlcore.config import PolicyConfig
from zmlcore.errors import RoutingError
from zmlcore.policy import FleetIndex, NodeView, RouteRequest, RoutingState, builtin_policy, choose_node, is_routable
from zmlcore.policy import fleet as fleet_module
from zmlcore.policy.choose import STRATEGIES
from zmlcore.policy.context import Cand
from zmlcore.policy.estimate import DEFAULT_LATENCY_TARGET_S, INF, MEAN_PROMPT_TOKENS, Coeffs, node_cost, node_speeds
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.strategies import chain as chain_strategy
from zmlcore.policy.types import FamilyEval

TYPES = ["nvidia_h100", "nvidia_a100", "amd_mi300x", "intel_gaudi2", "aws_inferentia2"]
FAMS = ["H100", "A100", "MI300X", "Gaudi2", "Inferentia2"]
STALE = 15.0


class RefGroup:
    def __init__(self, family: str, views: list[NodeView], table: SimpleNamespace) -> None:
        self.family = family
        self.views = views
        self.table = table
        self.members: list[int] = []
        self.keys = table.keys
        self.drains = table.drains


class RefCtx:
    """The strategies' view of a decision, computed node by node in plain Python."""

    def __init__(self, views: list[NodeView], req: RouteRequest, policy: ResolvedPolicy, now: float,
                 state: RoutingState) -> None:
        serving = [v for v in views if req.model in v.state.models or req.model in v.state.loading_models]
        fams: list[str] = []
        for v in serving:
            if v.state.family.lower() not in [f.lower() for f in fams]:
                fams.append(v.state.family)
        self.req, self.policy, self.now, self.state = req, policy, now, state
        cfg = policy.config
        self.target_s = cfg.latency_target_ms / 1000.0 if cfg.latency_target_ms else DEFAULT_LATENCY_TARGET_S
        self.prompt = float(req.prompt_tokens) if req.prompt_tokens > 0 else MEAN_PROMPT_TOKENS
        chain = policy.chain or tuple(fams)
        in_chain = {f.lower() for f in chain}
        t = self.table = SimpleNamespace(keys=[], drains=[], cost_cap=[], inv_pf=[], pf=[], depth=[], maxc=[], flat=[])
        groups = {f.lower(): RefGroup(f, serving, t) for f in fams}
        self.ok: list[bool] = []
        for i, v in enumerate(serving):
            st = v.state
            c = Coeffs(*node_speeds(st), node_cost(st))
            up = st.status == "up" and req.model in st.models
            t.keys.append(c.load_key(v.effective_outstanding(), v.effective_pending()) if up else INF)
            t.drains.append(c.drain_key(v.effective_outstanding()) if up else INF)
            t.cost_cap.append(c.cost_cap)
            t.inv_pf.append(c.inv_pf)
            t.pf.append(c.pf)
            t.depth.append(v.effective_outstanding())
            t.maxc.append(c.maxc)
            g = groups[st.family.lower()]
            g.members.append(i)
            t.flat.append((g, i))
            self.ok.append(
                up and is_routable(v, req.model, now, STALE) is None and st.family.lower() in in_chain
                and v.node_id not in req.exclude
                and (cfg.health_threshold is None or st.health_score >= cfg.health_threshold)
            )
        self.families = [(f, groups.get(f.lower())) for f in chain]
        self.evaluated: list[FamilyEval] | None = None

    def est(self, g: RefGroup, i: int) -> float:
        return self.table.keys[i] + self.prompt * self.table.inv_pf[i]

    def check(self, g: RefGroup, i: int) -> bool:
        return self.ok[i]

    def best_drain(self, g: RefGroup) -> int | None:
        best = None
        for i in g.members:
            if self.ok[i] and (best is None or self.table.drains[i] < self.table.drains[best]):
                best = i
        return best

    def candidates(self) -> list[Cand]:
        out: list[Cand] = []
        self.evaluated = []
        seen: set[str] = set()
        for rank, (fam, g) in enumerate(self.families):
            n = 0
            for i in g.members if g is not None else ():
                if self.ok[i] and fam.lower() not in seen:
                    out.append(Cand(g, i, self.est(g, i), rank))  # type: ignore[arg-type]
                    n += 1
            seen.add(fam.lower())
            self.evaluated.append(FamilyEval(fam, len(g.members) if g is not None else 0,
                                             None if n else ("no_routable_node" if g is not None else "no_nodes")))
        return out


def reference(views: list[NodeView], req: RouteRequest, policy: ResolvedPolicy, now: float,
              state: RoutingState) -> tuple[str, float, list[FamilyEval] | None] | None:
    ctx = RefCtx(views, req, policy, now, state)
    pick = STRATEGIES.get(policy.strategy, chain_strategy.select)(ctx)  # type: ignore[arg-type]
    if pick is None:
        return None
    return pick.cls.views[pick.i].node_id, pick.est, ctx.evaluated


def drifted(rng: random.Random, v: NodeView, now: float) -> None:
    """A health poll: EWMA speeds that wander a few percent, queues, status, age."""
    st = v.state
    pf, dec, _ = node_speeds(st)
    measured = rng.random() < 0.8  # some nodes report no speeds: the type's profile (ties)
    v.state = msgspec.structs.replace(
        st,
        prefill_tps=pf * rng.uniform(0.97, 1.03) if measured else 0.0,
        decode_tps=dec * rng.uniform(0.97, 1.03) if measured else 0.0,
        queue_running=rng.randint(0, 40), queue_waiting=rng.randint(0, 4),
        status=rng.choice(("up",) * 12 + ("down", "slow")),
        health_score=rng.uniform(40, 100),
        updated_at=now - rng.choice((0.0, 1.0, 3.0, 30.0)) if rng.random() < 0.1 else now,
    )


def make_fleet(rng: random.Random, n: int) -> list[NodeView]:
    views = []
    for i in range(n):
        t = rng.choice(TYPES)
        models = ("m",) if rng.random() < 0.9 else ("x",)
        loading = ("m",) if models == ("x",) and rng.random() < 0.5 else ()
        v = node(f"n{i}", t, models=models, loading=loading, outstanding=rng.randint(0, 40),
                 pending=rng.randint(0, 4), cost=rng.choice((None, None, 0.0, rng.uniform(1, 5))))
        drifted(rng, v, NOW)
        views.append(v)
    return views


def policies() -> list[ResolvedPolicy]:
    out = [builtin_policy(n) for n in ("latency", "cost", "availability", "round_robin", "balanced")]
    out.append(ResolvedPolicy("weighted", PolicyConfig(strategy="weighted", latency_weight=0.7, cost_weight=0.3,
                                                       queue_threshold=24), ()))
    out.append(ResolvedPolicy("weighted-cost", PolicyConfig(strategy="weighted", cost_weight=1.0), ()))
    out.append(ResolvedPolicy("weighted-none", PolicyConfig(strategy="weighted"), ()))
    for prio in ("latency", "cost", "balanced"):
        chain = ["A100", "MI300X", "H100"]
        cfg = PolicyConfig(accelerator_chain=chain, cost_priority=prio, queue_threshold=30,  # type: ignore[arg-type]
                           health_threshold=50.0, latency_target_ms=300)
        out.append(ResolvedPolicy(f"chain-{prio}", cfg, tuple(chain)))
    # Chains out of registration order (ties then go by rank, not row), with a family named
    # twice in another case, or leaving families out, under every strategy that reads ranks.
    every = ("Inferentia2", "H100", "Gaudi2", "A100", "MI300X")
    out.append(ResolvedPolicy("latency-chain", PolicyConfig(strategy="latency"), every))
    out.append(ResolvedPolicy("balanced-chain", PolicyConfig(cost_priority="balanced"), every))
    dup = ("gaudi2", "A100", "Gaudi2", "h100")
    out.append(ResolvedPolicy("weighted-dup", PolicyConfig(strategy="weighted", latency_weight=1.0, cost_weight=2.0), dup))
    out.append(ResolvedPolicy("chain-latency-dup", PolicyConfig(cost_priority="latency", queue_threshold=20), dup))
    out.append(ResolvedPolicy("availability-chain", PolicyConfig(strategy="availability"), ("MI300X", "A100")))
    out.append(ResolvedPolicy("round_robin-chain", PolicyConfig(strategy="round_robin"), ("MI300X", "A100")))
    out.append(ResolvedPolicy("cost-qt", PolicyConfig(strategy="cost", queue_threshold=12, health_threshold=70.0), ()))
    return out


@pytest.fixture(params=["rows", "scan"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force every table onto one decision path: numpy over the rows, or Python over them."""
    monkeypatch.setattr(fleet_module, "SMALL_TABLE", 0 if request.param == "rows" else 10**9)
    return str(request.param)


def agree(views: list[NodeView], pol: ResolvedPolicy, rng: random.Random, decisions: int) -> int:
    """Route ``decisions`` requests through a FleetIndex and through the scan, with polls and
    counter changes between them; assert they agree; return how many found a node."""
    fleet = FleetIndex(views)
    s_index, s_ref = RoutingState(), RoutingState()
    now = NOW
    agreed = 0
    for _ in range(decisions):
        for _ in range(rng.randint(0, 6)):  # polls since the last decision
            drifted(rng, rng.choice(views), now)
        prompt = rng.choice((0, rng.randint(1, 8000)))
        exclude = frozenset(rng.sample([v.node_id for v in views], min(2, len(views)))) if rng.random() < 0.2 else frozenset()
        req = RouteRequest(model="m", prompt_tokens=prompt, exclude=exclude)
        ref = reference(views, req, pol, now, s_ref)
        try:
            d = choose_node(fleet, req, pol, now, s_index, stale_after_s=STALE)
        except RoutingError:
            assert ref is None
            continue
        assert ref is not None, d
        node_id, est, evaluated = ref
        assert (d.node_id, d.estimated_ttft_s) == (node_id, est)
        if evaluated is not None:
            assert [e.as_dict() for e in d.evaluated] == [e.as_dict() for e in evaluated]
        else:
            assert d.evaluated == []
        agreed += 1
        v = fleet.get(d.node_id)
        assert v is not None
        v.outstanding += 1
        v.pending += 1
        w = rng.choice(views)
        w.outstanding = max(0, w.outstanding - rng.randint(0, 3))
        w.pending = max(0, w.pending - 1)
        if rng.random() < 0.05:
            w.cooldown_until = now + rng.uniform(0, 0.05)
        now += rng.uniform(0, 0.01)
    fleet.close()
    return agreed


@pytest.mark.parametrize("pol", policies(), ids=lambda p: p.name)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_index_picks_what_a_scan_of_every_node_picks(pol: ResolvedPolicy, seed: int, path: str) -> None:
    rng = random.Random(seed * 1000 + zlib.crc32(pol.name.encode()) % 997)
    views = make_fleet(rng, rng.choice((8, 40, 150)))
    assert agree(views, pol, rng, 150) > 50


@pytest.mark.parametrize("pol", policies(), ids=lambda p: p.name)
def test_small_fleets_pick_what_a_scan_picks(pol: ResolvedPolicy, path: str) -> None:
    """One to six nodes (what most routers see), many fleets."""
    rng = random.Random(zlib.crc32(pol.name.encode()))
    agreed = sum(agree(make_fleet(rng, n), pol, rng, 40) for n in (1, 1, 2, 2, 3, 4, 6) * 3)
    assert agreed > 100


def test_the_path_follows_the_table_size() -> None:
    rng = random.Random(4)
    small = FleetIndex(make_fleet(rng, 3)).table("m")
    large = FleetIndex(make_fleet(rng, 4 * fleet_module.SMALL_TABLE)).table("m")
    assert small.small and isinstance(small.key, list)
    assert not large.small and isinstance(large.key, np.ndarray)


def test_ties_between_identical_nodes_go_to_the_first_registered() -> None:
    views = [node("b1", "nvidia_a100"), node("h1"), node("h2"), node("b2", "nvidia_a100")]
    fleet = FleetIndex(views)
    assert choose_node(fleet, RouteRequest(model="m"), builtin_policy("latency"), NOW, RoutingState()).node_id == "h1"
    views[1].outstanding = 1
    assert choose_node(fleet, RouteRequest(model="m"), builtin_policy("availability"), NOW,
                       RoutingState()).node_id == "h2"


def test_decisions_do_not_change_the_index(path: str) -> None:
    rng = random.Random(5)
    views = make_fleet(rng, 60)
    fleet = FleetIndex(views)
    t = fleet.table("m")
    cols = ("key", "drain", "pf", "inv_pf", "cost_cap", "depth", "updated", "blocked", "health", "up", "n_up")
    before = [list(getattr(t, c)) for c in cols]
    for pol in policies():
        for _ in range(20):
            try:
                choose_node(fleet, RouteRequest(model="m", prompt_tokens=rng.randint(1, 4000),
                                                exclude=frozenset({"n1", "n2"})),
                            pol, NOW + rng.choice((0, 20)), RoutingState(), stale_after_s=STALE)
            except RoutingError:
                pass
    assert fleet.table("m") is t
    assert [list(getattr(t, c)) for c in cols] == before


def test_poll_updates_are_constant_work_and_never_rebuild() -> None:
    rng = random.Random(9)
    views = make_fleet(rng, 300)
    fleet = FleetIndex(views)
    fleet.table("m")
    builds = fleet.rebuilds
    for _ in range(3000):
        drifted(rng, rng.choice(views), NOW)
    assert fleet.rebuilds == builds
    st = views[0].state
    views[0].state = msgspec.structs.replace(st, models=[*st.models, "new"])
    fleet.table("m")
    assert fleet.rebuilds == builds + 1


def test_latency_near_ties_pick_the_slowest_prefill_like_the_scan() -> None:
    """An idle pool of one type whose speeds differ a little: the fastest node dominates every
    other on (estimate, cost), yet ``latency`` gives a near-tie to the slowest prefill."""
    rng = random.Random(11)
    views = []
    for i in range(60):
        v = node(f"h{i}")
        v.state = msgspec.structs.replace(v.state, prefill_tps=10_000 * rng.uniform(0.9, 1.1), decode_tps=60.0)
        views.append(v)
    fleet = FleetIndex(views)
    pol = builtin_policy("latency")
    for prompt in (50, 200, 400):
        req = RouteRequest(model="m", prompt_tokens=prompt)
        ref = reference(views, req, pol, NOW, RoutingState())
        d = choose_node(fleet, req, pol, NOW, RoutingState(), stale_after_s=STALE)
        assert ref is not None and (d.node_id, d.estimated_ttft_s) == ref[:2]
    slowest = min(views, key=lambda v: v.state.prefill_tps).node_id
    assert choose_node(fleet, RouteRequest(model="m", prompt_tokens=50), pol, NOW, RoutingState()).node_id == slowest


def test_exact_ties_go_to_the_earlier_chain_family_then_the_earlier_node(path: str) -> None:
    """Two families of identical idle nodes, registered X first, chained Y first: every score
    ties, and every strategy that ranks takes Y's first node (round robin takes the next in
    registration order), on both paths."""
    views = [node(n, family=n[0].upper()) for n in ("x1", "y1", "x2", "y2")]
    for pol in policies():
        if pol.name == "weighted-none":
            continue
        pol = ResolvedPolicy(pol.name, pol.config, ("Y", "X"))
        fleet = FleetIndex(views)
        req = RouteRequest(model="m", prompt_tokens=500)
        d = choose_node(fleet, req, pol, NOW, RoutingState(), stale_after_s=STALE)
        ref = reference(views, req, pol, NOW, RoutingState())
        assert ref is not None and (d.node_id, d.estimated_ttft_s) == ref[:2], pol.name
        assert d.node_id == ("x1" if pol.strategy == "round_robin" else "y1"), pol.name
        fleet.close()


def test_latency_near_tie_between_equal_prefill_speeds_takes_the_lower_estimate(path: str) -> None:
    """Equal prefill speeds within the near-tie window: the lower estimate wins, not the row."""
    a, b = node("a", pending=1), node("b")
    for v in (a, b):
        v.state = msgspec.structs.replace(v.state, prefill_tps=100_000.0)
    d = choose_node(FleetIndex([a, b]), RouteRequest(model="m", prompt_tokens=100), builtin_policy("latency"), NOW,
                    RoutingState())
    assert d.node_id == "b"


def test_chains_cached_per_table_stay_bounded() -> None:
    """Inline policies may name any permutation of the families: the per-table cache is capped."""
    import itertools

    from zmlcore.policy.context import MAX_CHAINS

    views = [node(f"n{i}", TYPES[i % 5]) for i in range(40)]
    fleet = FleetIndex(views)
    for n, chain in enumerate(itertools.islice(itertools.permutations(FAMS), 3 * MAX_CHAINS)):
        pol = ResolvedPolicy(f"p{n}", PolicyConfig(cost_priority="latency"), chain)
        d = choose_node(fleet, RouteRequest(model="m"), pol, NOW, RoutingState())
        assert d.family == chain[0]
        assert len(fleet.table("m").chains) <= MAX_CHAINS


def test_latency_near_tie_window_shrinks_as_a_node_fills(path: str) -> None:
    """A node's near-tie window shrinks with the share of its sequence slots taken (TIE_SLOTS):
    a 250-token prompt is 25 ms on the H100, 45 ms on the A100, 50 ms on the Gaudi2 (16 slots).
    With 1 request on the Gaudi2 its window is 28 ms and it wins the tie; with 8 (half its
    slots) it is 15 ms, and the tie goes to the idle A100 (20 ms behind, full 30 ms window)."""
    from zmlcore.policy.strategies import latency

    assert latency.TIE_S == 0.03 and latency.TIE_SLOTS == 1.0
    req = RouteRequest(model="m", prompt_tokens=250)
    pol = builtin_policy("latency")
    for outstanding, want in ((0, "gaudi2"), (1, "gaudi2"), (8, "a100"), (16, "a100")):
        views = fleet5()
        views[3].outstanding = outstanding
        d = choose_node(FleetIndex(views), req, pol, NOW, RoutingState(), stale_after_s=STALE)
        assert d.node_id == want, outstanding
        ref = reference(views, req, pol, NOW, RoutingState())
        assert ref is not None and (d.node_id, d.estimated_ttft_s) == ref[:2]
