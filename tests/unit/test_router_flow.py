"""The router's request flow (zml_router.request) driven by hand: no NATS, no HTTP.

Each test plays the service's part: it answers the flow's actions (Decide with a Decision or an
error, Dispatch with None or an AttemptError) and checks what the flow asks for next and which
error code the requester would get. The decisions come from the real policy code
(zmlcore.policy.admit) on a real node table where a test needs the half-open breaker.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from zmlcore.config import parse_config
from zmlcore.errors import NoHealthyNodesError, QueueFullError, ZMLError
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, RouteRequest, RoutingState, admit
from zmlcore.policy.resolve import builtin_policy
from zml_router.request import finish, route
from zml_router.node.attempt import AttemptError, Failure
from zmlcore.reply.transcript import Sent
from zml_router.node.result import AttemptResult, Close, Dispatch
from zml_router.outcome import Outcome
from zml_router.request.route import Decide, End, Enqueue, Penalise, Plan, ending
from zml_router.replicas.table import NodeTable


def _decision(node: str) -> Decision:
    return Decision(node_id=node, family="H100", policy="latency", estimated_ttft_s=0.1, queue_depth=0)


def _plan(**kw) -> Plan:  # type: ignore[no-untyped-def]
    base = dict(model="m", policy="latency", rr=RouteRequest(model="m"), max_attempts=3)
    base.update(kw)
    return Plan(**base)  # type: ignore[arg-type]


Decider = Callable[[RouteRequest], "Decision | ZMLError"]
Attempt = Callable[[Dispatch], "AttemptError | None"]


def _run(plan: Plan, decide: Decider, attempt: Attempt) -> tuple[list[object], Outcome, ZMLError | None]:
    """Drive the flow as the service does; the actions seen, the outcome and the error raised."""
    out = Outcome()
    seen: list[object] = []
    steps = route.route(plan, out)
    result: route.Result = None
    try:
        while True:
            action = steps.send(result)
            seen.append(action)
            if isinstance(action, Decide):
                result = decide(action.rr)
            elif isinstance(action, Dispatch):
                result = AttemptResult(error=attempt(action))
            elif isinstance(action, Close):
                result = AttemptResult()
            else:
                assert isinstance(action, (Enqueue, Penalise))
                result = None
    except StopIteration:
        return seen, out, None
    except ZMLError as exc:
        return seen, out, exc


def _fleet(*nodes: str) -> Decider:
    """Decide among ``nodes`` minus the excluded ones, in order."""
    def decide(rr: RouteRequest) -> Decision | ZMLError:
        for n in nodes:
            if n not in rr.exclude:
                return _decision(n)
        return NoHealthyNodesError("none left")
    return decide


def _failing(failures: dict[str, AttemptError]) -> Attempt:
    return lambda d: failures.get(d.decision.node_id)


def test_first_node_answers() -> None:
    seen, out, err = _run(_plan(), _fleet("a", "b"), _failing({}))
    assert err is None and out.ok and out.attempts == 1 and out.node_id == "a"
    assert [type(a) for a in seen] == [Decide, Dispatch]


def test_a_failed_node_is_penalised_excluded_and_the_next_one_serves() -> None:
    boom = AttemptError(Failure.NETWORK, 0, "refused")
    seen, out, err = _run(_plan(), _fleet("a", "b"), _failing({"a": boom}))
    assert err is None and out.ok and out.node_id == "b" and out.attempts == 2
    assert [type(a) for a in seen] == [Decide, Dispatch, Penalise, Decide, Dispatch]
    assert seen[2].decision.node_id == "a" and seen[2].error is boom  # type: ignore[attr-defined]
    assert seen[3].rr.exclude == frozenset({"a"})  # type: ignore[attr-defined]
    assert out.failed_nodes == ["a"]


def test_every_node_failing_is_backend_error_not_no_healthy_nodes() -> None:
    boom = AttemptError(Failure.SERVER, 500, "oops")
    _, out, err = _run(_plan(), _fleet("a", "b"), _failing({"a": boom, "b": boom}))
    assert err is not None and err.code == "BACKEND_ERROR" and not out.ok
    assert out.failed_nodes == ["a", "b"] and out.node_error


def test_attempts_are_bounded() -> None:
    boom = AttemptError(Failure.NETWORK, 0, "x")
    seen, out, err = _run(_plan(max_attempts=2), _fleet("a", "b", "c"), _failing({n: boom for n in "abc"}))
    assert err is not None and err.code == "BACKEND_ERROR"
    assert sum(isinstance(a, Dispatch) for a in seen) == 2


def test_slow_nodes_are_recorded_and_cooled() -> None:
    slow = AttemptError(Failure.SLOW, 0, "no first byte")
    _, out, err = _run(_plan(), _fleet("a", "b"), _failing({"a": slow}))
    assert err is None and out.slow_nodes == ["a"] and out.failed_nodes == ["a"]
    assert finish.penalty(slow, 1.0, 5.0) == ("cooldown", 5.0)


def test_a_client_error_is_bad_request_with_no_retry_and_no_penalty() -> None:
    seen, _, err = _run(_plan(), _fleet("a", "b"), _failing({"a": AttemptError(Failure.CLIENT, 400, "bad")}))
    assert err is not None and err.code == "BAD_REQUEST"
    assert [type(a) for a in seen] == [Decide, Dispatch]


def test_an_engines_refusal_is_told_in_its_own_words() -> None:
    vllm = ('{"error":{"message":"This model\'s maximum context length is 8192 tokens. However, you requested '
            '9000 tokens.","type":"BadRequestError","param":null,"code":400}}')
    _, _, err = _run(_plan(), _fleet("a"), _failing({"a": AttemptError(Failure.CLIENT, 400, vllm)}))
    assert err is not None and err.message == ("node a rejected the request: 400 BadRequestError: This model's "
                                               "maximum context length is 8192 tokens. However, you requested "
                                               "9000 tokens.")
    failed = AttemptError(Failure.SERVER, 500, '{"error":"CUDA out of memory","error_type":"generation"}')
    _, _, err = _run(_plan(max_attempts=1), _fleet("a"), _failing({"a": failed}))
    assert err is not None and err.message.endswith("last: server 500 generation: CUDA out of memory"), err.message


def test_no_model_everywhere_is_model_not_loaded() -> None:
    gone = AttemptError(Failure.NO_MODEL, 404, "unknown model")
    _, _, err = _run(_plan(), _fleet("a"), _failing({"a": gone}))
    assert err is not None and err.code == "MODEL_NOT_LOADED"


def test_no_node_at_all_passes_the_decision_error_through() -> None:
    _, out, err = _run(_plan(), _fleet(), _failing({}))
    assert err is not None and err.code == "NO_HEALTHY_NODES" and out.attempts == 0


# --- saturation ------------------------------------------------------------------------------

def _saturated(rr: RouteRequest) -> ZMLError:
    return QueueFullError("all busy")


def test_saturation_without_queueing_is_queue_full() -> None:
    _, out, err = _run(_plan(), _saturated, _failing({}))
    assert err is not None and err.code == "QUEUE_FULL" and not out.queued


def test_saturation_with_queueing_enqueues() -> None:
    seen, out, err = _run(_plan(can_queue=True), _saturated, _failing({}))
    assert err is None and out.queued and not out.ok
    assert isinstance(seen[-1], Enqueue) and seen[-1].saturated


def test_arrivals_queue_behind_waiting_requests_without_deciding() -> None:
    seen, out, err = _run(_plan(can_queue=True, others_waiting=True), _fleet("a"), _failing({}))
    assert err is None and out.queued
    assert len(seen) == 1 and isinstance(seen[0], Enqueue) and not seen[0].saturated
    # The queue's own head is being placed: it does not go behind itself.
    seen, out, _ = _run(_plan(can_queue=True, others_waiting=True, from_queue=True), _fleet("a"), _failing({}))
    assert out.ok and [type(a) for a in seen] == [Decide, Dispatch]


def test_every_node_overloaded_is_saturation() -> None:
    busy = AttemptError(Failure.OVERLOADED, 503, "queue full", retry_after=2.0)
    seen, out, err = _run(_plan(can_queue=True), _fleet("a", "b"), _failing({"a": busy, "b": busy}))
    assert err is None and out.queued and isinstance(seen[-1], Enqueue) and seen[-1].saturated
    assert out.failed_nodes == []  # overloaded is not a node fault
    _, out, err = _run(_plan(), _fleet("a", "b"), _failing({"a": busy, "b": busy}))
    assert err is not None and err.code == "QUEUE_FULL" and err.retry_after == 2.0
    assert err.routing_context is not None and err.routing_context["nodes_tried"] == ["a", "b"]
    assert finish.penalty(busy, 1.0, 5.0) == ("saturated", 2.0)
    assert finish.penalty(AttemptError(Failure.OVERLOADED, 503, "", retry_after=0.0), 1.0, 5.0) == ("saturated", 1.0)


def test_a_pinned_overloaded_node_says_so() -> None:
    busy = AttemptError(Failure.OVERLOADED, 429, "")
    _, _, err = _run(_plan(rr=RouteRequest(model="m", accelerator_id="a"), max_attempts=1), _fleet("a"),
                     _failing({"a": busy}))
    assert err is not None and err.code == "QUEUE_FULL" and "'a' is overloaded" in err.message
    assert err.routing_context is not None and err.routing_context["policy"] == "pinned"


def test_saturation_after_a_failure_is_the_failure_not_a_queue() -> None:
    boom = AttemptError(Failure.NETWORK, 0, "reset")
    decided: list[RouteRequest] = []

    def decide(rr: RouteRequest) -> Decision | ZMLError:
        decided.append(rr)
        return _decision("a") if len(decided) == 1 else QueueFullError("busy")

    _, out, err = _run(_plan(can_queue=True), decide, _failing({"a": boom}))
    assert err is not None and err.code == "BACKEND_ERROR" and not out.queued


# --- streaming ---------------------------------------------------------------------------------

def test_a_stream_broken_before_its_first_token_fails_over() -> None:
    boom = AttemptError(Failure.NETWORK, 0, "reset")
    seen, out, err = _run(_plan(stream=True), _fleet("a", "b"), _failing({"a": boom}))
    assert err is None and out.ok and out.node_id == "b"
    assert all(a.stream for a in seen if isinstance(a, Dispatch))


def test_a_stream_broken_mid_way_without_what_was_sent_ends_in_an_error() -> None:
    broken = AttemptError(Failure.NETWORK, 0, "reset", mid_stream=True)
    seen, out, err = _run(_plan(stream=True), _fleet("a", "b"), _failing({"a": broken}))
    assert err is not None and err.code == "BACKEND_ERROR" and "mid-stream" in err.message
    assert [type(a) for a in seen] == [Decide, Dispatch, Penalise]  # penalised, never re-dispatched
    assert out.failed_nodes == ["a"]


CHAT = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10,"stream":true}'


def _cut(tokens: int = 3, **kw) -> AttemptError:  # type: ignore[no-untyped-def]
    return AttemptError(Failure.NETWORK, 0, "reset", mid_stream=True,
                        sent=Sent(text="x " * tokens, tokens=tokens, **kw))


def test_a_stream_broken_mid_way_is_continued_on_another_node() -> None:
    seen, out, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b"), _failing({"a": _cut(3)}))
    assert err is None and out.ok and out.node_id == "b"
    decides = [a for a in seen if isinstance(a, Decide)]
    dispatches = [a for a in seen if isinstance(a, Dispatch)]
    assert [d.continuation for d in decides] == [False, True]  # only engines that can continue
    assert [d.continuation for d in dispatches] == [False, True] and dispatches[1].rr.exclude == {"a"}
    assert any(isinstance(a, Penalise) for a in seen)  # the node is cooled all the same
    assert out.continued_from == [("a", 3, "network")] and out.failed_nodes == ["a"]


def test_a_continuation_that_breaks_is_continued_again_while_attempts_last() -> None:
    seen, out, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b", "c"),
                          _failing({"a": _cut(2), "b": _cut(5)}))
    assert err is None and out.node_id == "c" and out.continued_from == [("a", 2, "network"), ("b", 5, "network")]
    seen, out, err = _run(_plan(stream=True, raw=CHAT, max_attempts=2), _fleet("a", "b", "c"),
                          _failing({"a": _cut(2), "b": _cut(5)}))
    assert err is not None and "no attempt left" in err.message


@pytest.mark.parametrize(("raw", "kw", "why"), [
    (CHAT.replace(b'"stream"', b'"seed":1,"stream"'), {}, "seed"),
    (CHAT.replace(b'"stream"', b'"n":2,"stream"'), {}, "n > 1"),
    (CHAT.replace(b'"stream"', b'"logprobs":true,"stream"'), {}, "logprobs"),
    (CHAT.replace(b'"stream"', b'"response_format":{"type":"json_object"},"stream"'), {}, "constrained"),
    (CHAT, {"continue_asked": False}, "continue_on_failure"),
    (CHAT, {"policy_continues": False}, "continue_on_failure"),
    (CHAT, {"rr": RouteRequest(model="m", accelerator_id="a")}, "pinned"),
    (b'{"model":"m","prompt":[1,2,3],"stream":true}', {}, "token ids"),
])
def test_an_answer_that_must_not_be_continued_ends_with_the_error(raw: bytes, kw: dict, why: str) -> None:
    seen, out, err = _run(_plan(stream=True, raw=raw, **kw), _fleet("a", "b"), _failing({"a": _cut(3)}))
    assert err is not None and err.code == "BACKEND_ERROR" and why in err.message, err
    assert not any(isinstance(a, Dispatch) and a.continuation for a in seen)


@pytest.mark.parametrize(("raw", "kw"), [
    (CHAT.replace(b'"max_tokens":10', b'"max_tokens":3'), {}),
    (CHAT.replace(b'"max_tokens":10', b'"max_completion_tokens":3'), {}),
    # ending a whole answer is not continuing it: these would refuse a continuation
    (CHAT.replace(b'"max_tokens":10', b'"max_tokens":3,"seed":1'), {}),
    (CHAT.replace(b'"max_tokens":10', b'"max_tokens":3'), {"continue_asked": False}),
    (CHAT.replace(b'"max_tokens":10', b'"max_tokens":3'), {"rr": RouteRequest(model="m", accelerator_id="a")}),
])
def test_an_answer_cut_after_its_last_token_is_closed_not_continued(raw: bytes, kw: dict) -> None:
    seen, out, err = _run(_plan(stream=True, raw=raw, **kw), _fleet("a", "b"), _failing({"a": _cut(3)}))
    assert err is None and out.ok, err
    assert [type(a) for a in seen] == [Decide, Dispatch, Penalise, Close]  # no node asked for more
    assert seen[-1] == Close("a", 1, continued_from="a@3:network") and out.continued_from == [("a", 3, "network")]


def test_a_finished_answer_missing_only_its_usage_is_closed() -> None:
    seen, out, err = _run(_plan(stream=True, raw=CHAT, usage_asked=True), _fleet("a", "b"),
                          _failing({"a": _cut(3, finished=True)}))
    assert err is None and isinstance(seen[-1], Close) and not seen[-1].whole
    assert any(isinstance(a, Penalise) for a in seen)  # the node failed before the usage
    # tool-call deltas end with their own reason: a finished one is closed, a cut one is not
    _, _, err = _run(_plan(stream=True, raw=CHAT.replace(b'"max_tokens":10', b'"max_tokens":3')), _fleet("a", "b"),
                     _failing({"a": _cut(3, blocked="tool-call deltas")}))
    assert err is not None and "tool-call deltas" in err.message
    seen, _, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b"),
                        _failing({"a": _cut(3, finished=True, blocked="tool-call deltas")}))
    assert err is None and isinstance(seen[-1], Close)


def test_a_resumed_stream_with_the_whole_answer_is_closed_by_the_new_router() -> None:
    whole = Sent(text="x x x ", tokens=3)
    out = Outcome()
    out.continued_from = [("a", 3, "router")]
    steps = route.route(_plan(stream=True, raw=CHAT.replace(b'"max_tokens":10', b'"max_tokens":3'),
                             resumed=whole, attempts_before=1), out)
    assert next(steps) == Close("a", 1, continued_from="a@3:router")
    with pytest.raises(StopIteration):
        steps.send(AttemptResult())
    assert out.ok
    # with tokens still to come, it is continued as before
    steps = route.route(_plan(stream=True, raw=CHAT, resumed=whole, attempts_before=1), Outcome())
    first = next(steps)
    assert isinstance(first, Decide) and first.continuation


def test_tool_call_deltas_already_sent_are_not_continued() -> None:
    _, _, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b"),
                     _failing({"a": _cut(3, blocked="tool-call deltas")}))
    assert err is not None and "tool-call deltas" in err.message


def test_a_non_streamed_answer_that_cannot_be_continued_starts_again_elsewhere() -> None:
    # Nothing of it reached the caller (mid_stream False): a plain failover, from scratch.
    cut = AttemptError(Failure.NETWORK, 0, "reset", sent=Sent(text="x ", tokens=1))
    raw = CHAT.replace(b'"stream":true', b'"seed":3')
    seen, out, err = _run(_plan(raw=raw), _fleet("a", "b"), _failing({"a": cut}))
    assert err is None and out.node_id == "b" and out.continued_from == []
    assert [a.continuation for a in seen if isinstance(a, Dispatch)] == [False, False]
    # ... and one that can be continued is (no work thrown away).
    seen, out, err = _run(_plan(raw=CHAT.replace(b'"stream":true', b'"stream":false')), _fleet("a", "b"),
                          _failing({"a": cut}))
    assert err is None and [a.continuation for a in seen if isinstance(a, Dispatch)] == [False, True]


def test_a_node_refusing_the_continuation_is_a_backend_error_not_a_bad_request() -> None:
    refused = AttemptError(Failure.CLIENT, 400, "prefill is incompatible with thinking", mid_stream=True)
    _, _, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b"), _failing({"a": _cut(2), "b": refused}))
    assert err is not None and err.code == "BACKEND_ERROR" and "refused to continue" in err.message


# --- deadlines -----------------------------------------------------------------------------------

def test_deadline_errors_carry_the_right_codes() -> None:
    err = finish.deadline_passed(2.5)
    assert err.code == "TIMEOUT" and "2.5 s" in err.message
    q = finish.queue_expired(1200)
    assert q.code == "QUEUE_FULL" and q.retry_after == 1.0
    assert q.routing_context == {"final_error": "queue_timeout", "waited_ms": 1200,
                                 "recommendation": "increase fleet capacity or max_queue_ms"}


# --- the half-open breaker, with the real policy code ---------------------------------------------

def _admission() -> tuple[Decider, NodeTable]:
    """The router's decision (zmlcore.policy.admit) on a real two-node table."""
    cfg = parse_config({})
    table = NodeTable(cfg.families())
    now = time.time()
    for node_id in ("a", "b"):
        table.upsert(NodeState(node_id=node_id, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                               status="up", models=["m"], updated_at=now))
    policy, state, rc = builtin_policy("latency"), RoutingState(), cfg.router

    def decide(rr: RouteRequest) -> Decision | ZMLError:
        try:
            return admit(table.nodes(), rr, policy, time.time(), state, stale_after_s=rc.stale_after_s,
                         ttft_bound_s=rc.admission_ttft_s)
        except ZMLError as exc:
            return exc
    return decide, table


def test_half_open_probe_when_every_node_cools_down() -> None:
    adm, table = _admission()
    now = time.time()
    table.views["a"].cooldown_until = now + 30
    table.views["b"].cooldown_until = now + 5
    seen, out, err = _run(_plan(), adm, _failing({}))
    assert err is None and out.ok and out.node_id == "b"  # the soonest back gets one more chance
    assert table.views["a"].cooldown_until > now


def test_a_failed_half_open_probe_is_penalised_and_the_next_soonest_probed() -> None:
    adm, table = _admission()
    now = time.time()
    table.views["a"].cooldown_until = now + 30
    table.views["b"].cooldown_until = now + 5
    boom = AttemptError(Failure.SERVER, 500, "still broken")
    seen, out, err = _run(_plan(), adm, _failing({"b": boom}))
    penalised = [a.decision.node_id for a in seen if isinstance(a, Penalise)]
    assert penalised == ["b"] and out.ok and out.node_id == "a"


def test_no_probe_for_nodes_that_are_down() -> None:
    adm, table = _admission()
    for v in table.views.values():
        v.state = NodeState(node_id=v.node_id, accelerator_type="nvidia_h100", family="H100", endpoint="http://x",
                            status="down", models=["m"], updated_at=time.time())
    _, _, err = _run(_plan(), adm, _failing({}))
    assert err is not None and err.code == "NO_HEALTHY_NODES"


@pytest.mark.parametrize("stream", [False, True])
def test_the_flow_is_a_plain_generator(stream: bool) -> None:
    """No event loop, no I/O: the flow is a generator of actions (what the service drives)."""
    steps = route.route(_plan(stream=stream), Outcome())
    first = next(steps)
    assert isinstance(first, Decide)
    second = steps.send(_decision("a"))
    assert isinstance(second, Dispatch) and second.stream is stream and second.attempt == 1
    with pytest.raises(StopIteration):
        steps.send(AttemptResult())


# --- a stream whose router died, sent again with what its requester has (Zml-Resume) -------------
def test_a_resumed_stream_is_continued_from_its_first_attempt_and_counts_on() -> None:
    sent = Sent(text="x x x ", tokens=3)
    seen, out, err = _run(_plan(stream=True, raw=CHAT, resumed=sent, attempts_before=1), _fleet("a", "b"),
                          _failing({}))
    assert err is None and out.ok and out.node_id == "a"
    dispatches = [a for a in seen if isinstance(a, Dispatch)]
    assert [d.continuation for d in dispatches] == [True] and dispatches[0].attempt == 2 and out.attempts == 2
    assert [d.continuation for d in seen if isinstance(d, Decide)] == [True]  # an engine that continues


def test_a_resumed_stream_that_must_not_be_continued_ends_interrupted() -> None:
    raw = CHAT.replace(b'"stream"', b'"seed":1,"stream"')
    seen, _, err = _run(_plan(stream=True, raw=raw, resumed=Sent(text="x ", tokens=1)), _fleet("a"), _failing({}))
    assert err is not None and err.code == "STREAM_INTERRUPTED" and "seed" in err.message
    assert not any(isinstance(a, Dispatch) for a in seen)
    _, _, err = _run(_plan(stream=True, raw=CHAT, resumed=Sent(text="x ", tokens=1, blocked="tool-call deltas")),
                     _fleet("a"), _failing({}))
    assert err is not None and "tool-call deltas" in err.message


def test_a_resumed_stream_whose_continuation_breaks_is_continued_again() -> None:
    _, out, err = _run(_plan(stream=True, raw=CHAT, resumed=Sent(text="x ", tokens=1)), _fleet("a", "b"),
                       _failing({"a": _cut(4)}))
    assert err is None and out.node_id == "b" and out.continued_from == [("a", 4, "network")]


# --- how an answer a node stopped part-way ends: one rule (route.ending) -------------------------
@pytest.mark.parametrize(("sent", "kw", "end"), [
    (Sent(tokens=3, finished=True), {}, End.WHOLE),  # finish out, usage not asked
    (Sent(tokens=3, finished=True, usage={"total_tokens": 9}), {"usage_asked": True}, End.WHOLE),
    (Sent(tokens=3, finished=True), {"usage_asked": True}, End.CLOSE),  # the usage is missing
    (Sent(tokens=10), {}, End.CLOSE),  # every token max_tokens allowed
    (Sent(tokens=3), {}, End.CONTINUE),
    (Sent(tokens=3), {"continue_asked": False}, End.FAIL),
    (Sent(tokens=3, finished=True), {"stream": False}, End.CONTINUE),  # a whole reply has no stream to end
])
def test_how_an_answer_ends_is_decided_in_one_step(sent: Sent, kw: dict, end: End) -> None:
    plan = _plan(**{"stream": True, "raw": CHAT, **kw})
    got, why = ending(plan, sent, 1)
    assert got is end and (why is not None) == (end is End.FAIL), (got, why)


def test_a_node_that_fails_after_the_end_of_its_answer_ends_the_stream_unblamed() -> None:
    seen, out, err = _run(_plan(stream=True, raw=CHAT), _fleet("a", "b"), _failing({"a": _cut(3, finished=True)}))
    assert err is None and out.ok and out.node_id == "a"
    assert [type(a) for a in seen] == [Decide, Dispatch, Close] and seen[-1] == Close("a", 1, whole=True)
    assert out.failed_nodes == [] and not out.node_error and out.continued_from == []


def test_a_node_that_refuses_the_stream_is_asked_as_the_caller_asked_on_the_same_attempt() -> None:
    refused = AttemptError(Failure.CLIENT, 400, "stream_options", stream_refused=True)
    seen, out, err = _run(_plan(), _fleet("a", "b"), lambda d: None if d.whole else refused)
    assert err is None and out.ok
    dispatches = [a for a in seen if isinstance(a, Dispatch)]
    assert [(d.decision.node_id, d.attempt, d.whole) for d in dispatches] == [("a", 1, False), ("a", 1, True)]
    assert not any(isinstance(a, Penalise) for a in seen)
    # refused again asked as it came: the caller's request is at fault
    seen, out, err = _run(_plan(), _fleet("a", "b"), lambda d: refused)
    assert err is not None and err.code == "BAD_REQUEST" and sum(isinstance(a, Dispatch) for a in seen) == 2

