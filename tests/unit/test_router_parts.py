"""The router's parts built alone, from what each uses (no RouterService, no broker): the
saturation queue's glue and the metrics' scrape-time view."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

from zmlcore.config import parse_config
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest, RoutingState, admit
from zmlcore.reply.keepalive import KeepaliveBook
from zml_router.request.cancels import CancelBook
from zml_router.request.intake import owner_key
from zml_router.replicas.ids import RequestIds
from zml_router.replicas.limits import IdentityLimits
from zml_router.telemetry.metrics import QUEUE_WAIT, RouterMetrics
from zml_router.incoming import QueuedMsg
from zml_router.queue.jetstream import H_ENQUEUED
from zml_router.answer.replies import Replies
from zml_router.queue.glue import QueueGlue
from zml_router.replicas.table import NodeTable

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _table(now: float) -> NodeTable:
    table = NodeTable()
    for node_id, acc, fam in (("h1", "nvidia_h100", "H100"), ("g1", "intel_gaudi2", "Gaudi2")):
        table.upsert(NodeState(node_id=node_id, accelerator_type=acc, family=fam, endpoint="http://x",
                               status="up", models=["m"], updated_at=now))
    return table


class _Glue:
    """A QueueGlue on a real table, with the spawned coroutines kept (not run)."""

    def __init__(self, bound: float = 30.0) -> None:
        self.cfg = parse_config({"router": {"admission_ttft_s": bound}})
        self.table = _table(time.time())
        self.spawned: list[Coroutine[Any, Any, None]] = []
        self.cancels = CancelBook()
        self.ids = RequestIds("r-test", 60)
        state = RoutingState()

        def decide(rr: RouteRequest, policy: ResolvedPolicy, headers: dict[str, str], ahead: int) -> Decision:
            return admit(self.table.nodes(), rr, policy, time.time(), state, stale_after_s=15.0, ttft_bound_s=bound)

        def spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
            self.spawned.append(coro)
            return None  # type: ignore[return-value]  # never awaited here

        async def enter(msg: QueuedMsg) -> None:
            pass

        self.metrics = RouterMetrics(self.cfg, self.table, {})
        replies = Replies(KeepaliveBook(), self.ids, IdentityLimits())
        self.glue = QueueGlue(self.cfg, self.table, decide, self.metrics, replies, self.cancels, self.ids,
                              enter, spawn)

    def close(self) -> None:
        for coro in self.spawned:
            coro.close()


def _wait_count(model: str) -> float:
    return sum(s.value for m in QUEUE_WAIT.metric.collect() for s in m.samples
               if s.name.endswith("_count") and s.labels.get("model") == model)


def test_asking_whether_a_queued_head_has_room_does_not_observe_its_wait() -> None:
    """Regression: the queue asks again each time capacity may have freed (and after a node
    refused the head at once); every "yes" used to observe the head's queue wait, so one
    request's wait was counted several times. It is observed once, when a node takes it."""
    g = _Glue()
    qmsg = QueuedMsg("zml.infer", BODY, "_INBOX.x", {H_ENQUEUED: f"{time.time() - 1:.3f}"})
    before = _wait_count("m")
    assert g.glue.has_room(qmsg) and g.glue.has_room(qmsg)
    assert _wait_count("m") == before
    g.glue._waited(qmsg)
    assert _wait_count("m") == before + 1


def test_no_room_for_the_head_while_every_node_is_over_the_admission_bound() -> None:
    g = _Glue(bound=2.0)
    qmsg = QueuedMsg("zml.infer", BODY, "_INBOX.x", {})
    assert g.glue.has_room(qmsg)
    for node_id in ("h1", "g1"):
        g.table.add_own(node_id, 200, 0)
    assert not g.glue.has_room(qmsg)
    g.table.add_own("h1", -200, 0)  # a node freed: the head goes
    assert g.glue.has_room(qmsg)
    # Not a capacity question (a body no policy can route): the request path answers it.
    assert g.glue.has_room(QueuedMsg("zml.infer", b"{not json", "_INBOX.x", {}))


def test_a_cancelled_head_is_dropped_and_its_id_claim_released() -> None:
    g = _Glue()
    headers = {"Zml-Request-Id": "r-1", "Zml-Id-Claim": "7"}
    qmsg = QueuedMsg("zml.infer", BODY, "_INBOX.x", headers)
    assert not g.glue.cancelled(qmsg) and not g.spawned
    g.cancels.add(owner_key("_INBOX.x", headers, "r-1"), time.time())
    assert g.glue.cancelled(qmsg)
    assert len(g.spawned) == 1  # the claim's release, on a task the router waits for
    g.close()


def test_metrics_read_the_table_and_the_requests_in_flight_at_scrape_time() -> None:
    cfg = parse_config({})
    table = _table(time.time())
    in_flight: dict[str, object] = {"a": object(), "b": object()}
    metrics = RouterMetrics(cfg, table, in_flight)
    table.add_own("h1", 3, 1)
    table.views["g1"].cooldown_until = time.time() + 30
    families = {f.name: f for f in metrics.collect()}
    assert families["zml_router_in_flight"].samples[0].value == 2
    inflight = {s.labels["node"]: s.value for s in families["zml_node_in_flight"].samples}
    assert inflight == {"h1": 3, "g1": 0}
    cooldown = {s.labels["node"]: s.value for s in families["zml_node_cooldown_seconds"].samples}
    assert 29 < cooldown["g1"] <= 30 and cooldown["h1"] == 0
    del in_flight["a"]
    families = {f.name: f for f in metrics.collect()}
    assert families["zml_router_in_flight"].samples[0].value == 1
