"""The routing simulator feeds the policies what the router has: the body-size prompt estimate,
pending until completion for non-streamed requests (or until the estimated first token),
peers' counters after a NATS lag, and the admission bound (benches/routing_sim.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import routing_sim  # noqa: E402
from routing_simrouter import DELTA, EXPIRE, SimRouters  # noqa: E402

from zmlcore.messages import NodeState  # noqa: E402
from zmlcore.policy import NodeView  # noqa: E402
from zmlcore.policy.estimate import prompt_tokens_from_body  # noqa: E402


def _routers(replicas: int = 2, **kw) -> tuple[SimRouters, list[list[NodeView]], list[tuple]]:
    views = [[NodeView(NodeState(node_id=f"n{i}", accelerator_type="nvidia_h100", family="H100", endpoint=""))
              for i in range(2)] for _ in range(replicas)]
    events: list[tuple] = []
    return SimRouters(views, 10, **kw), views, events


def _counts(views: list[list[NodeView]], node: int = 0) -> list[tuple[int, int]]:
    return [(rep[node].outstanding, rep[node].pending) for rep in views]


def test_body_estimate_is_the_routers_and_near_the_true_length() -> None:
    arr, P, _O = routing_sim.make_trace(5000, 10.0, False, seed=3)
    body, streamed = routing_sim.make_requests(P, seed=3, stream_share=0.5)
    est = np.array([prompt_tokens_from_body(b) for b in body])
    ratio = est / np.array(P)
    assert 0.95 < float(np.median(ratio)) < 1.15  # ~4 chars per token plus a small envelope
    assert float(np.std(np.log(ratio))) > 0.1  # but not exact: per-request chars per token vary
    assert abs(np.mean(streamed) - 0.5) < 0.03
    # drawn apart from the trace: the arrivals and lengths are those every policy shares
    assert routing_sim.make_trace(5000, 10.0, False, seed=3) == (arr, P, _O)


def test_peer_deltas_arrive_after_the_lag_own_counters_at_once() -> None:
    r, views, ev = _routers(lag=(0.010, 0.050))
    push = lambda t, k, a, b: ev.append((t, k, a, b))  # noqa: E731
    r.dispatch(0, 0, 0, True, 0.1, 100.0, push)
    assert _counts(views) == [(1, 1), (0, 0)]
    [(t, kind, rj, key)] = ev
    assert kind == DELTA and rj == 1 and 100.010 <= t <= 100.050
    r.deliver(rj, key)
    assert _counts(views) == [(1, 1), (1, 1)]


def test_instant_sharing_and_no_sharing() -> None:
    r, views, ev = _routers()
    r.dispatch(0, 1, 0, True, 0.1, 0.0, ev.append)
    assert _counts(views) == [(1, 1), (1, 1)] and ev == []
    r, views, ev = _routers(share=False)
    r.dispatch(0, 1, 0, True, 0.1, 0.0, ev.append)
    assert _counts(views) == [(0, 0), (1, 1)] and ev == []


def test_non_streamed_request_stays_pending_until_completion() -> None:
    r, views, ev = _routers(replicas=1)
    push = lambda *e: ev.append(e)  # noqa: E731
    r.dispatch(0, 0, 0, False, 0.1, 0.0, push)
    r.dispatch(1, 0, 0, True, 0.1, 0.0, push)
    r.first_token(0, False, 0.1, push)  # the router sees no first token of a plain reply
    r.first_token(1, True, 0.1, push)
    assert _counts(views) == [(2, 1)]
    r.complete(0, 5.0, push)
    r.complete(1, 5.0, push)
    assert _counts(views) == [(0, 0)] and ev == []


def test_non_streamed_pending_expires_at_the_estimated_first_token() -> None:
    r, views, ev = _routers(replicas=1, expiry=1.0)
    push = lambda *e: ev.append(e)  # noqa: E731
    r.dispatch(0, 0, 0, False, 0.25, 10.0, push)
    assert ev == [(10.25, EXPIRE, 0, 0)]
    r.expire(0, 10.25, push)
    assert _counts(views) == [(1, 0)]
    r.complete(0, 12.0, push)  # no second decrement
    assert _counts(views) == [(0, 0)]
    # completion before the estimate: the late expiry changes nothing
    r.dispatch(1, 0, 0, False, 9.0, 20.0, push)
    r.complete(1, 21.0, push)
    r.expire(1, 29.0, push)
    assert _counts(views) == [(0, 0)]


@pytest.mark.parametrize("policy", ["latency", "oracle"])
def test_admission_bound_rejects_what_it_cannot_serve_in_time(policy: str) -> None:
    kw = dict(policy=policy, workload="poisson", load=1.4, seed=5, n=4000, warm=400)
    bounded = routing_sim.run(**kw, opts={"admission_s": 3.0})
    unbounded = routing_sim.run(**kw, opts={"admission_s": 0})
    assert unbounded["rejected"] == 0.0 and bounded["rejected"] > 0.1  # 40% over capacity
    assert bounded["p99"] < unbounded["p99"] / 3
    if policy == "oracle":  # exact TTFTs: nothing admitted waits past the bound
        assert bounded["p99"] <= 3.0 + 1e-6


def test_lagged_replicas_run_and_report() -> None:
    res = routing_sim.run("latency_r4_lag10_50", "poisson", 0.8, 5, 3000, 300)
    assert res["rejected"] == 0.0 and 0.5 < res["thr"] < 1.0 and res["p99"] < 5.0
    assert res["opts"]["pending_expiry"] == routing_sim.DEFAULT_OPTS["pending_expiry"]


def test_the_routers_pending_window_is_the_decisions_estimate() -> None:
    """The router computes the window from its view just before dispatch; the simulator takes
    the decision's estimate: the same number."""
    from zmlcore.policy import FleetIndex, RouteRequest, RoutingState, builtin_policy, choose_node
    from zmlcore.policy.estimate import NONSTREAM_PENDING_FOR, nonstream_pending_s

    views = [NodeView(NodeState(node_id="h", accelerator_type="nvidia_h100", family="H100", endpoint="",
                                status="up", models=["m"], updated_at=0.0, queue_running=40, queue_waiting=3),
                      outstanding=2, pending=1)]
    d = choose_node(FleetIndex(views), RouteRequest(model="m", prompt_tokens=700), builtin_policy("latency"),
                    0.0, RoutingState())
    v = views[0]
    assert nonstream_pending_s(v.state, v.effective_outstanding(), v.effective_pending(), 700) == pytest.approx(
        NONSTREAM_PENDING_FOR * d.estimated_ttft_s)
    assert d.estimated_ttft_s > 1.0  # the slot wait counts


# --- shared-prefix workloads (cache-aware routing) ---

def test_a_conversations_turns_extend_each_other_in_both_views() -> None:
    """The engine's units and the router's bytes of turn k+1 start with those of turn k (and
    the reply's units, cached at completion, are in turn k+1's units)."""
    from routing_simworkload import UNIT, Builder, make_workload

    plan = make_workload("chat", 3000, 5, lambda mp, mo, mn: 10.0)
    assert plan.mean_new < plan.mean_p / 3  # most of a turn's prompt is its conversation so far
    b = Builder(plan, 5)
    last: dict[int, object] = {}
    checked = 0
    for r in range(3000):
        p = b.build(r)
        assert p.tokens == plan.P[r] and len(p.units) == p.tokens // UNIT
        if p.session in last:
            q = last[p.session]
            assert p.data.startswith(q.data)  # type: ignore[attr-defined]
            assert p.units[:len(q.units_out)] == q.units_out  # type: ignore[attr-defined]
            checked += 1
        last[p.session] = p
    assert checked > 1500


def test_the_engine_cache_counts_whole_blocks_and_evicts_tails_first() -> None:
    from routing_simnode import EngineCache

    c = EngineCache(128, 40 * 16)  # 5 blocks of 128 tokens = 40 units
    a, b = list(range(100, 132)), list(range(100, 108)) + list(range(200, 224))
    assert c.store(a) == (32, 0)
    assert c.cached_tokens(a, 32 * 16 + 5) == 32 * 16 and c.cached_tokens(a, 32 * 16) == 3 * 128
    assert c.store(b) == (24, 16)  # shares a's first block; a's tail goes
    assert c.depth(a) == 16 and c.depth(b) == 32


def test_the_cache_policy_keeps_conversations_warm(tmp_path: Path) -> None:
    """A short chat run: the cache-aware policy (the router's real index, fed what the router
    has) finds more of the prompts cached than today's latency policy, with a lower p90."""
    a = routing_sim.run("latency", "chat", 0.8, 7, 4000, 400)
    b = routing_sim.run("cache", "chat", 0.8, 7, 4000, 400)
    assert b["hit"] > a["hit"] + 0.1 and b["p90"] < a["p90"]
    assert a["input"] == b["input"]  # the same trace
