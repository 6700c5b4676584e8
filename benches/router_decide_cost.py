"""The router's decision call on a 1- and a 2-node fleet: ``zmlcore.policy.admit`` on its
``NodeTable`` (choose_node plus the admission bound) and the in-flight counting around it
(``add_own`` at dispatch and at completion), thread CPU time per request, best of 5 runs.

    python benches/router_decide_cost.py
    # before/after: another commit's zmlcore under the same router code
    PYTHONPATH=$SCRATCH/before/libs/zmlcore/src python benches/router_decide_cost.py
"""

from __future__ import annotations

import time

from zml_router.replicas.table import NodeTable
from zmlcore.config import RouterConfig
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, RouteRequest, RoutingState, admit, builtin_policy


def main() -> None:
    for n in (1, 2):
        table = NodeTable()
        for i in range(n):
            table.upsert(NodeState(
                node_id=f"n{i}", accelerator_type="nvidia_h100", family="H100", endpoint=f"http://n{i}",
                status="up", models=["m"], max_concurrency=32, cost_per_hour=2.5, health_score=100.0,
                updated_at=time.time() + 3600,
            ))
        rc, state, pol = RouterConfig(), RoutingState(), builtin_policy("balanced")

        def decide(rr: RouteRequest, now: float) -> Decision:  # as RouterService.admit
            return admit(table.nodes(), rr, pol, now, state, stale_after_s=rc.stale_after_s,
                         ttft_bound_s=rc.admission_ttft_s)

        rr = RouteRequest(model="m", prompt_tokens=300)
        now = time.time()
        for _ in range(5):  # the second call with the same list builds the watching index
            decide(rr, now)
        best = []
        for _ in range(5):
            k = 5000
            t0 = time.thread_time_ns()
            for _ in range(k):
                d = decide(rr, now)
                table.add_own(d.node_id, 1, 1)
                table.add_own(d.node_id, -1, -1)
            best.append((time.thread_time_ns() - t0) / k / 1000)
        print(f"{n} node(s): admit + add_own(+1, +1) + add_own(-1, -1): {min(best):.1f} us of thread CPU "
              f"per request (best of 5 runs of 5,000, `balanced`)")


if __name__ == "__main__":
    main()
