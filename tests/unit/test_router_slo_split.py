"""The router's splitter and flow gate around a request with targets (zml_router.request.split,
zml_router.request.flowgate): a request admitted whole on its targets is not split over a pair
estimated to miss one that whole meets; one split by the decider has the split's verdict and
teaches its decode node's TPOT calibration, not the node admission chose."""

from __future__ import annotations

import dataclasses
import time

from zmlcore.config import parse_config
from zmlcore.flowctl.slo import model_tpot
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, RouteRequest, RoutingState
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.policy.resolve import builtin_policy
from zml_router.replicas.table import NodeTable
from zml_router.request.flowgate import FlowGate, targets
from zml_router.request.split import Splitter


def setup() -> tuple[NodeTable, Splitter, FlowGate, float]:
    now = time.time()
    cfg = parse_config({"disaggregation": {"enabled": True}})
    table = NodeTable()
    # inf2 prefills fast enough and decodes slowly; h100 decodes 3x faster, over a slow link (1 Gbit/s)
    for i, acc, pf, dec in (("inf2", "aws_inferentia2", 3000.0, 18.0), ("h100", "nvidia_h100", 10000.0, 60.0)):
        table.upsert(NodeState(node_id=i, accelerator_type=acc, family=acc.upper(), endpoint=f"http://{i}",
                               backend="vllm", status="up", models=["m"], kv_group="g", kv_gbps=1.0,
                               updated_at=now, prefill_tps=pf, decode_tps=dec))
    return table, Splitter(cfg, table), FlowGate(cfg, table, RoutingState(), PrefixIndex(), "r"), now


def test_a_split_that_would_miss_a_target_whole_meets_is_not_taken() -> None:
    table, sp, gate, now = setup()
    pol = builtin_policy("latency")
    whole = Decision(node_id="inf2", family="AWS_INFERENTIA2", policy="latency", queue_depth=0)
    # 1,000 tokens and a long answer: the faster decoder saves ~15 s of decode, its first token
    # comes ~1.2 s out (1 s of transfer) against ~0.33 s whole
    rr = RouteRequest(model="m", prompt_tokens=1000, max_tokens=400)
    d, why = sp.decide(whole, rr, pol, now)
    assert why == "split_better" and d.prefill_node == "inf2" and d.node_id == "h100"
    # admitted whole on a 1 s TTFT target: the split would miss it, even though 0.2 s late weighs
    # less than the decode it saves in the decider's score
    note = gate.note("zml.infer", "me", {"Zml-Ttft-Slo-Ms": "1000"}, "m")
    d, why = sp.decide(whole, rr, pol, now, ttft_target_s=targets(note)[0])
    assert why == "slo" and d.node_id == "inf2" and not d.prefill_node
    # a target the split meets too: split
    loose = gate.note("zml.infer", "me", {"Zml-Ttft-Slo-Ms": "3000"}, "m")
    d, why = sp.decide(whole, rr, pol, now, ttft_target_s=targets(loose)[0])
    assert why == "split_better" and d.prefill_node == "inf2"
    assert 1.0 < d.estimated_ttft_s < 3.0  # the split's own estimate, not whole's


def test_a_request_split_by_the_decider_has_the_splits_verdict_and_calibrates_its_decode_node() -> None:
    table, sp, gate, now = setup()
    pol = builtin_policy("latency")
    rr = RouteRequest(model="m", prompt_tokens=1000, max_tokens=400)
    note = gate.note("zml.infer", "me", {"Zml-Ttft-Slo-Ms": "3000"}, "m")
    assert note is not None
    # admitted whole on inf2 (h100 kept out of the whole decision: the policy would take it)
    whole = gate.decide(dataclasses.replace(rr, exclude=frozenset({"h100"})), pol, note, False)
    assert whole.node_id == note.node_id == "inf2"
    d, _ = sp.decide(whole, rr, pol, now, ttft_target_s=targets(note)[0])
    assert d.prefill_node == "inf2" and d.node_id == "h100"
    gate.redirected(note, d, "m")
    assert note.node_id == d.node_id and note.model_tpot == model_tpot(table.views[d.node_id], "m")
    assert note.verdict is not None and note.verdict.ttft_s == d.estimated_ttft_s
