"""A split request in the router's flow (zml_router.request.route), driven by hand: the prefill
leg, then the decode leg with what it handed over; a failed prefill leg is tried once more on
another prefill node for the same decode node, then the request is served whole there, and the
reply says so; a retry after a failed split attempt is never split again."""

from __future__ import annotations

import dataclasses
import doctest

from zmlcore.errors import ZMLError
from zmlcore.policy import Decision, RouteRequest
from zml_router.node import legs
from zml_router.node.attempt import AttemptError, Failure
from zml_router.node.result import AttemptResult, Dispatch, Handoff
from zml_router.outcome import Outcome
from zml_router.request import route
from zml_router.request.route import Decide, Penalise, Plan, Prefill


def split_decision(node: str = "dec", prefill: str = "pf") -> Decision:
    return Decision(node_id=node, family="Gaudi2", policy="latency", queue_depth=0, prefill_node=prefill)


def drive(prefill_result: Handoff | AttemptError | list[Handoff | AttemptError],
          dispatch_results: list[AttemptError | None], refill: str = "pf2"
          ) -> tuple[list[object], Outcome, ZMLError | None]:
    """Run the flow: the first decision splits over (pf, dec); a refill (another prefill node for
    dec) names ``refill`` ("" : whole on dec); prefill legs answer ``prefill_result`` in turn."""
    out = Outcome()
    seen: list[object] = []
    steps = route.route(Plan(model="m", policy="latency", rr=RouteRequest(model="m"), max_attempts=3), out)
    result: route.Result = None
    results = iter(dispatch_results)
    legs_ = iter(prefill_result if isinstance(prefill_result, list) else [prefill_result])
    try:
        while True:
            action = steps.send(result)
            seen.append(action)
            if isinstance(action, Decide) and action.refill is not None:
                assert action.refill.node_id == "dec" and not action.refill.prefill_node
                result = dataclasses.replace(action.refill, prefill_node=refill)
            elif isinstance(action, Decide):
                result = split_decision() if action.split else dataclasses.replace(split_decision("other"),
                                                                                      prefill_node="")
            elif isinstance(action, Prefill):
                result = next(legs_)
            elif isinstance(action, Dispatch):
                result = AttemptResult(error=next(results))
            else:
                result = None
    except StopIteration:
        return seen, out, None
    except ZMLError as exc:
        return seen, out, exc


def test_prefill_then_decode_with_the_handoff() -> None:
    h = Handoff("pf", {"kv_transfer_params": {"remote_engine_id": "e"}}, 12.0)
    seen, out, err = drive(h, [None])
    assert err is None and out.ok and out.prefill_failed is None
    pre = [a for a in seen if isinstance(a, Prefill)]
    disp = [a for a in seen if isinstance(a, Dispatch)]
    assert len(pre) == 1 and pre[0].decision.prefill_node == "pf"
    assert len(disp) == 1 and disp[0].handoff is h and disp[0].decision.node_id == "dec"
    assert disp[0].decision.prefill_node == ""


def test_a_failed_prefill_leg_is_prefilled_again_on_another_node_for_the_same_decode_node() -> None:
    h = Handoff("pf2", {"kv_transfer_params": {"remote_engine_id": "e2"}}, 30.0)
    seen, out, err = drive([AttemptError(Failure.NETWORK, 0, "reset"), h], [None])
    assert err is None and out.ok and out.prefill_failed == "pf:network" and out.failed_nodes == ["pf"]
    pen = [a for a in seen if isinstance(a, Penalise)]
    assert len(pen) == 1 and pen[0].decision.node_id == "pf"
    refills = [a for a in seen if isinstance(a, Decide) and a.refill is not None]
    assert len(refills) == 1 and refills[0].rr.exclude == frozenset({"pf"})  # the lost node is out
    pre = [a for a in seen if isinstance(a, Prefill)]
    assert [p.decision.prefill_node for p in pre] == ["pf", "pf2"]
    disp = [a for a in seen if isinstance(a, Dispatch)]
    assert len(disp) == 1 and disp[0].handoff is h and disp[0].decision.node_id == "dec"
    assert out.attempts == 1


def test_a_second_failed_prefill_leg_serves_the_request_whole_on_the_decode_node() -> None:
    seen, out, err = drive([AttemptError(Failure.NETWORK, 0, "reset"), AttemptError(Failure.SERVER, 500, "boom")],
                           [None])
    assert err is None and out.ok and out.prefill_failed == "pf:network,pf2:server"
    assert out.failed_nodes == ["pf", "pf2"]
    assert [a.decision.node_id for a in seen if isinstance(a, Penalise)] == ["pf", "pf2"]
    disp = [a for a in seen if isinstance(a, Dispatch)]
    assert len(disp) == 1 and disp[0].handoff is None and disp[0].decision.node_id == "dec"
    assert disp[0].decision.prefill_node == ""


def test_when_no_other_prefill_node_pays_the_request_is_served_whole_on_the_decode_node() -> None:
    seen, out, err = drive(AttemptError(Failure.SLOW, 0, "no prefill within 30 s"), [None], refill="")
    assert err is None and out.ok and out.prefill_failed == "pf:slow"
    assert len([a for a in seen if isinstance(a, Prefill)]) == 1
    disp = [a for a in seen if isinstance(a, Dispatch)]
    assert len(disp) == 1 and disp[0].handoff is None and disp[0].decision.node_id == "dec"


def test_a_prefill_leg_the_node_refused_as_a_bad_request_is_not_tried_elsewhere() -> None:
    seen, out, err = drive(AttemptError(Failure.CLIENT, 400, "bad"), [None])
    assert not [a for a in seen if isinstance(a, Decide) and a.refill is not None]
    assert out.prefill_failed == "pf:client" and out.failed_nodes == []


def test_after_a_failed_decode_leg_the_retry_is_not_split() -> None:
    seen, out, err = drive(Handoff("pf", {}, 1.0), [AttemptError(Failure.SERVER, 500, "boom"), None])
    assert err is None and out.ok
    decides = [a for a in seen if isinstance(a, Decide)]
    assert [d.split for d in decides] == [True, False]
    disp = [a for a in seen if isinstance(a, Dispatch)]
    assert disp[-1].decision.node_id == "other" and disp[-1].handoff is None


def test_leg_bodies() -> None:
    assert doctest.testmod(legs).failed == 0
    import msgspec
    body = b'{"model":"m","messages":[],"max_tokens":50,"max_completion_tokens":50,"stream":true,"min_tokens":3}'
    v = msgspec.json.decode(legs.prefill_body("vllm", body))
    assert v["max_tokens"] == v["max_completion_tokens"] == 1 and v["stream"] is False and "min_tokens" not in v
    assert v["kv_transfer_params"]["do_remote_decode"] is True
    ll = msgspec.json.decode(legs.prefill_body("llamacpp", body))
    assert ll["id_slot"] == legs.LLAMA_SLOT and ll["cache_prompt"] is True and "kv_transfer_params" not in ll
    d = msgspec.json.decode(legs.decode_body(body, Handoff("pf", {"kv_transfer_params": {"x": 1}})))
    assert d["kv_transfer_params"] == {"x": 1} and d["max_tokens"] == 50 and d["stream"] is True


def test_the_prefill_leg_is_a_span_of_its_own() -> None:
    import pytest
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from zmlcore.telemetry import tracing
    from zml_router.telemetry import tracing as rtrace

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(True)
    tracing._tracer = provider.get_tracer("zml")  # this test's provider, not the process's
    try:
        headers: dict[str, str] = {}
        with rtrace.prefill_leg("pf-1", "dec-1"):
            tracing.inject(headers)
        with pytest.raises(RuntimeError), rtrace.prefill_leg("pf-2", "dec-1"):
            raise RuntimeError("reset")
    finally:
        tracing.enable(False)
    ok, bad = exporter.get_finished_spans()
    assert ok.name == "zml.prefill pf-1" and ok.attributes["zml.decode_node"] == "dec-1"
    assert headers["traceparent"].split("-")[2] == format(ok.context.span_id, "016x")  # the node gets this span
    assert bad.status.status_code is StatusCode.ERROR and bad.attributes["error.type"] == "RuntimeError"


def test_the_splitter_on_the_routers_table() -> None:
    """zml_router.request.split: engines without a leg protocol are never legs, a split names
    its decode node's family, and a conversation's mode is remembered."""
    import time as _time

    from zmlcore.config import parse_config
    from zmlcore.messages import NodeState
    from zmlcore.policy.resolve import builtin_policy
    from zml_router.replicas.table import NodeTable
    from zml_router.request.split import Splitter

    now = _time.time()
    cfg = parse_config({"disaggregation": {"enabled": True}})
    table = NodeTable()

    def node(i: str, acc: str, backend: str, roles: list[str], outstanding: int = 0) -> None:
        table.upsert(NodeState(node_id=i, accelerator_type=acc, family=acc.upper(), endpoint=f"http://{i}",
                               backend=backend, status="up", models=["m"], roles=roles, kv_group="g", kv_gbps=400.0,
                               updated_at=now, cost_per_hour=2.0))
        table.views[i].outstanding = outstanding

    node("pf", "nvidia_h100", "vllm", ["prefill"])
    node("dec", "intel_gaudi2", "vllm", ["decode"], 10)
    node("tgi", "nvidia_h100", "tgi", ["prefill"])
    sp = Splitter(cfg, table)
    whole = Decision(node_id="dec", family="INTEL_GAUDI2", policy="latency", queue_depth=10)
    rr = RouteRequest(model="m", prompt_tokens=6000, max_tokens=200)
    d, why = sp.decide(whole, rr, builtin_policy("latency"), now, "conv-1")
    assert why == "split_better" and d.prefill_node == "pf" and d.node_id == "dec" and d.family == "INTEL_GAUDI2"
    assert sp.modes["conv-1"] == "split"
    # the TGI node (no leg protocol) is never chosen, even as the only prefill node left
    d, why = sp.decide(whole, dataclasses.replace(rr, exclude=frozenset({"pf"})), builtin_policy("latency"), now)
    assert why == "no_pair" and d.prefill_node == ""


def test_a_split_leg_is_admitted_like_a_request() -> None:
    """Each leg takes a slot of its node: under [flow] hold_when_full, flow control keeps a
    split's legs off the nodes it keeps the request off (no free slot; for a tenant over its
    share, none beyond the reserve), and a split over the admission bound is not taken."""
    import time as _time

    from zmlcore.config import parse_config
    from zmlcore.messages import NodeState
    from zmlcore.policy import RoutingState
    from zmlcore.policy.prefix import PrefixIndex
    from zmlcore.policy.resolve import builtin_policy
    from zml_router.replicas.table import NodeTable
    from zml_router.request.flowgate import FlowGate
    from zml_router.request.split import Splitter

    now = _time.time()

    def setup(flow: dict[str, object], router: dict[str, object] | None = None
              ) -> tuple[NodeTable, Splitter, FlowGate]:
        # always: the pair is what is tested here, not whether it pays
        cfg = parse_config({"disaggregation": {"enabled": True, "always": True}, "flow": flow, "router": router or {}})
        table = NodeTable()
        # pf-a prefills 100x faster than pf-b: the estimate prefers it even when it is full
        for i, acc, roles, out, pf in (("pf-a", "nvidia_h100", ["prefill"], 8, 200_000.0),
                                       ("pf-b", "cpu", ["prefill"], 0, 2_000.0),
                                       ("dec", "intel_gaudi2", ["decode"], 10, 5_000.0)):
            table.upsert(NodeState(node_id=i, accelerator_type=acc, family=acc.upper(), endpoint=f"http://{i}",
                                   backend="vllm", status="up", models=["m"], roles=roles, kv_group="g",
                                   kv_gbps=400.0, updated_at=now, max_concurrency=8 if i == "pf-a" else 16,
                                   prefill_tps=pf))
            table.views[i].outstanding = out
        return table, Splitter(cfg, table), FlowGate(cfg, table, RoutingState(), PrefixIndex(), "r")

    whole = Decision(node_id="dec", family="INTEL_GAUDI2", policy="latency", queue_depth=10)
    rr = RouteRequest(model="m", prompt_tokens=6000, max_tokens=200)
    pol = builtin_policy("latency")
    # pf-a holds 8 of its 8 slots: without hold_when_full that is only an input of the estimate
    # (which still prefers it); with it, no leg goes there, as no request would
    table, sp, gate = setup({})
    note = gate.note("zml.infer", "me", {"Zml-Priority": "standard"}, "m")
    d, _ = sp.decide(whole, rr, pol, now, no_room=gate.no_room(note, "m"))
    assert d.prefill_node == "pf-a"
    table, sp, gate = setup({"hold_when_full": True})
    note = gate.note("zml.infer", "me", {}, "m")
    assert gate.no_room(note, "m") == frozenset({"pf-a"})
    d, _ = sp.decide(whole, rr, pol, now, no_room=gate.no_room(note, "m"))
    assert d.prefill_node == "pf-b" and d.node_id == "dec"
    # the slot frees: pf-a takes the leg again
    table.views["pf-a"].outstanding = 7
    d, _ = sp.decide(whole, rr, pol, now, no_room=gate.no_room(note, "m"))
    assert d.prefill_node == "pf-a"
    # sheddable work leaves the reserve (25%: 2 of 8 slots) free: 7 held, no leg for it there
    shed = gate.note("zml.infer", "me", {"Zml-Priority": "sheddable"}, "m")
    assert shed is not None and gate.no_room(shed, "m") >= {"pf-a"}
    d, _ = sp.decide(whole, rr, pol, now, no_room=gate.no_room(shed, "m"))
    assert d.prefill_node == "pf-b"
    # the admission bound applies to the split as to the request
    table, sp, gate = setup({}, {"admission_ttft_s": 0.05})
    d, why = sp.decide(whole, rr, pol, now)
    assert why == "over_bound" and d.prefill_node == "" and d.node_id == "dec"


def test_the_splitters_index_follows_a_large_tables_states() -> None:
    """Over 16 nodes the splitter decides on a SplitIndex built once per membership change: a
    node that leaves its kv_group or whose engine has no leg protocol is no leg from its next
    state on, and one that joins a group is, without a rebuild."""
    import msgspec
    import time as _time

    from zmlcore.config import parse_config
    from zmlcore.messages import NodeState
    from zmlcore.policy.resolve import builtin_policy
    from zml_router.replicas.table import NodeTable
    from zml_router.request.split import Splitter

    now = _time.time()
    cfg = parse_config({"disaggregation": {"enabled": True}})
    table = NodeTable()
    for i in range(20):
        fast = i == 7
        table.upsert(NodeState(node_id=f"n{i:02d}", accelerator_type="nvidia_h100" if fast else "intel_gaudi2",
                               family="X", endpoint=f"http://n{i}", backend="vllm", status="up", models=["m"],
                               roles=["prefill"] if fast else ["decode"], kv_group="g", kv_gbps=400.0,
                               updated_at=now, cost_per_hour=2.0))
        table.views[f"n{i:02d}"].outstanding = 0 if fast else 10
    sp = Splitter(cfg, table)
    whole = Decision(node_id="n03", family="X", policy="latency", queue_depth=10)
    rr = RouteRequest(model="m", prompt_tokens=6000, max_tokens=200)
    d, why = sp.decide(whole, rr, builtin_policy("latency"), now)
    assert sp._index is not None and why == "split_better" and d.prefill_node == "n07"
    index = sp._index
    v = table.views["n07"]
    v.state = msgspec.structs.replace(v.state, backend="tgi")  # no leg protocol: never a leg
    d, why = sp.decide(whole, rr, builtin_policy("latency"), now)
    assert why == "no_pair" and d.prefill_node == ""
    v.state = msgspec.structs.replace(v.state, backend="vllm", kv_group="")  # out of the group
    assert sp.decide(whole, rr, builtin_policy("latency"), now)[1] == "no_pair"
    v.state = msgspec.structs.replace(v.state, kv_group="g")  # back
    assert sp.decide(whole, rr, builtin_policy("latency"), now)[0].prefill_node == "n07"
    assert sp._index is index  # not rebuilt


def test_the_requests_own_targets_reach_the_decider() -> None:
    """A request's SLO (Zml-Ttft-Slo-Ms / Zml-Tpot-Slo-Ms, zml_router.request.flowgate.targets)
    is what the splitter scores against: a short prompt on a node too slow for its TPOT target
    is split off it; a split whose first token comes after its TTFT target is not taken when
    whole is within it."""
    import time as _time

    from zmlcore.config import parse_config
    from zmlcore.messages import NodeState
    from zmlcore.policy import RoutingState
    from zmlcore.policy.prefix import PrefixIndex
    from zmlcore.policy.resolve import builtin_policy
    from zml_router.replicas.table import NodeTable
    from zml_router.request.flowgate import FlowGate, targets
    from zml_router.request.split import Splitter

    now = _time.time()
    cfg = parse_config({"disaggregation": {"enabled": True}})
    table = NodeTable()
    for i, acc, pf, dec in (("inf2", "aws_inferentia2", 3000.0, 18.0), ("h100", "nvidia_h100", 10000.0, 60.0)):
        table.upsert(NodeState(node_id=i, accelerator_type=acc, family=acc.upper(), endpoint=f"http://{i}",
                               backend="vllm", status="up", models=["m"], kv_group="g", kv_gbps=1.0,
                               updated_at=now, prefill_tps=pf, decode_tps=dec))
    sp = Splitter(cfg, table)
    gate = FlowGate(cfg, table, RoutingState(), PrefixIndex(), "r")
    pol = builtin_policy("latency")
    whole = Decision(node_id="inf2", family="AWS_INFERENTIA2", policy="latency", queue_depth=0)
    short = RouteRequest(model="m", prompt_tokens=60, max_tokens=200)
    assert targets(None) == (None, None)
    assert sp.decide(whole, short, pol, now)[1] == "short_prompt"
    slo = gate.note("zml.infer", "me", {"Zml-Tpot-Slo-Ms": "50"}, "m")
    assert targets(slo) == (None, 0.05)
    d, why = sp.decide(whole, short, pol, now, tpot_target_s=targets(slo)[1])
    assert why == "split_better" and d.node_id == "h100" and d.prefill_node == "inf2"
    # 1,000 tokens split for the faster decoder, the first token ~1.2 s out (the slow link: 1 s of
    # transfer) against 0.33 s whole: within the policy's 2 s, split; the request's 0.5 s, whole
    mid = RouteRequest(model="m", prompt_tokens=1000, max_tokens=40)
    d, why = sp.decide(whole, mid, pol, now)
    assert why == "split_better" and d.node_id == "h100" and d.transfer_s > 0.5
    tight = gate.note("zml.infer", "me", {"Zml-Ttft-Slo-Ms": "500"}, "m")
    assert targets(tight) == (0.5, None)
    d, why = sp.decide(whole, mid, pol, now, ttft_target_s=targets(tight)[0])
    assert why == "whole_better" and d.node_id == "inf2" and not d.prefill_node
