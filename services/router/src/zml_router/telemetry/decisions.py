"""The replica's memory of its recent routing decisions, so a decision id from a reply's
metadata (``x-zml-decision-id``, ``zml.decision_id``) can be looked up: ``zml why ID`` and
``GET /v1/decisions/{id}`` ask every replica on ``zml.admin.routers.decision``; the one that
remembers it answers with a :class:`zmlcore.messages.DecisionRecord`.

Per attempt the request path keeps references only (the decision, its routing info, the node
state it read, the request's outcome): a deque append and a dict store, no copy and no
encoding. The record is built when someone asks, so it says what happened since (answered,
failed, moved to another node). The last :data:`KEPT` decisions are kept: minutes of traffic
at a busy replica, a few hundred KB.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from zmlcore.messages import DecisionFamily, DecisionRecord, NodeState, RoutingInfo
from zmlcore.policy import Decision
from zml_router.outcome import Outcome

#: Decisions remembered per replica.
KEPT = 8192


class _Kept(NamedTuple):
    at: float
    model: str
    attempt: int
    decision: Decision
    info: RoutingInfo
    state: NodeState
    out: Outcome


class DecisionLog:
    def __init__(self, router_id: str, kept: int = KEPT) -> None:
        self.router_id = router_id
        self.kept = kept
        self._by_id: dict[str, _Kept] = {}
        self._order: deque[str] = deque()

    def remember(self, info: RoutingInfo, decision: Decision, state: NodeState, model: str, attempt: int,
                 out: Outcome) -> None:
        did = info.decision_id
        self._by_id[did] = _Kept(time.time(), model, attempt, decision, info, state, out)
        self._order.append(did)
        if len(self._order) > self.kept:
            self._by_id.pop(self._order.popleft(), None)

    def __len__(self) -> int:
        return len(self._by_id)

    def record(self, decision_id: str) -> DecisionRecord | None:
        kept = self._by_id.get(decision_id)
        if kept is None:
            return None
        d, info, st, out = kept.decision, kept.info, kept.state, kept.out
        if out.info is not info and out.info is not None:
            outcome = "moved"  # a later attempt (failover, continuation) went elsewhere
        elif out.ok:
            outcome = "ok"
        elif out.error_code:
            outcome = "failed"
        else:
            outcome = "in_flight"
        return DecisionRecord(
            decision_id=decision_id, router_id=self.router_id, request_id=info.request_id, at=kept.at,
            model=kept.model, policy=d.policy, node_id=d.node_id, accelerator_type=info.accelerator_type,
            family=d.family, attempt=kept.attempt, queue_depth=d.queue_depth, estimated_ttft_s=d.estimated_ttft_s,
            cached_tokens_estimated=d.cached_tokens, session=d.session,
            prefill_tps=st.prefill_tps, decode_tps=st.decode_tps, speeds_source=st.speeds_source,
            speeds_at=st.speeds_at, speeds_confidence=st.speeds_confidence,
            evaluated=[DecisionFamily(family=e.family, nodes_checked=e.nodes_checked,
                                      rejected_reason=e.rejected_reason or "") for e in d.evaluated],
            outcome=outcome, error_code=out.error_code if outcome == "failed" else "",
            time_to_first_token=info.time_to_first_token,
        )
