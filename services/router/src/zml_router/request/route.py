"""Route: decide, dispatch, fail over or queue, as a generator of actions (step 3 of
zml_router.request; the model is httpx's ``auth_flow``)."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Union

from zmlcore.errors import (
    BackendError,
    BadRequestError,
    ModelNotLoadedError,
    QueueFullError,
    StreamInterruptedError,
    ZMLError,
)
from zmlcore.policy import Decision, RouteRequest
from zmlcore.reply.engineerror import engine_error
from zmlcore.reply.transcript import Sent

from zml_router.answer import continuation
from zml_router.node.attempt import AttemptError, Failure
from zml_router.answer.record import continued_from
from zml_router.node.result import AttemptResult, Close, Dispatch, Handoff
from zml_router.outcome import Outcome

log = logging.getLogger("zml.router")

#: Failures that are the node's fault: it is cooled down and counted as a node error.
NODE_FAULTS = (Failure.NETWORK, Failure.SERVER, Failure.SLOW)
#: Prefill legs tried for one split after the first fails, each on another prefill node for the
#: same decode node; after them the request is served whole on the decode node. One: a second
#: prefill node lost in the same request is rare, and each try costs the request a prefill.
PREFILL_FAILOVERS = 1


@dataclass(slots=True)
class Plan:
    """What the flow needs to know of one request (all decided before it starts)."""

    model: str
    policy: str  # the resolved policy's name, for error context
    rr: RouteRequest
    max_attempts: int
    stream: bool = False
    #: The policy queues on saturation and the request has somewhere to be answered.
    can_queue: bool = False
    #: Other requests for this model wait in the queue already (a new arrival goes behind them).
    others_waiting: bool = False
    #: This request is the head of the queue being placed (it never re-enters the queue behind others).
    from_queue: bool = False
    #: Whether an answer whose node fails part-way may be continued elsewhere: the request's
    #: body, its ``continue_on_failure`` (None: not given) and its policy's.
    raw: bytes = b""
    continue_asked: bool | None = None
    policy_continues: bool = True
    #: What the requester has of the answer when its router died (``Intake.resume``): the
    #: first attempt continues it; and the attempts made before, counted on.
    resumed: Sent | None = None
    attempts_before: int = 0
    #: The requester asked for the usage chunk (stream_options.include_usage).
    usage_asked: bool = False


@dataclass(slots=True)
class Decide:
    rr: RouteRequest
    #: Only nodes whose engine can continue an answer (zml_router.replicas.table.engine_continues).
    continuation: bool = False
    #: The decision may split the request into a prefill leg and a decode leg
    #: (zmlcore.policy.split); not after a split attempt of it failed, nor for a continuation.
    split: bool = True
    #: A split whose prefill leg failed: keep its decode node (this decision, its prefill node
    #: cleared) and find it another prefill node, or serve the request whole there if no other
    #: pays (the splitter's estimate, the failed node in ``rr.exclude``).
    refill: Decision | None = None


@dataclass(slots=True)
class Prefill:
    """Run a split request's prefill leg on ``decision.prefill_node`` -> the
    :class:`~zml_router.node.result.Handoff` for its decode leg, or the AttemptError."""

    decision: Decision
    rr: RouteRequest


@dataclass(slots=True)
class Penalise:
    decision: Decision
    error: AttemptError


@dataclass(slots=True)
class Enqueue:
    #: True: no room now (a queue head goes back to its holder, keeping its place); False: it
    #: joins the queue behind the requests already waiting there.
    saturated: bool


Action = Union[Decide, Prefill, Dispatch, Penalise, Enqueue, Close]
#: What the service sends back: a Decision or ZMLError for Decide, a Handoff or AttemptError for
#: Prefill, an AttemptResult for Dispatch and Close, None otherwise.
Result = Union[Decision, ZMLError, AttemptError, Handoff, AttemptResult, None]
Flow = Generator[Action, Result, None]


class End(enum.Enum):
    """How an answer a node stopped producing part-way ends (:func:`ending`)."""

    WHOLE = "whole"  # the requester has all it asked for: only the stream's end is missing
    CLOSE = "close"  # it has every token: the router ends it (zml_router.answer.continuation.complete)
    CONTINUE = "continue"  # another node continues it
    FAIL = "fail"  # it cannot be continued


def ending(plan: Plan, sent: Sent, attempt: int) -> tuple[End, str | None]:
    """The one rule for an answer whose node failed (or whose router died) after part of it went
    out: how it ends, and why not continued when it fails. ``attempt``: the attempts made."""
    if plan.stream and sent.finished and (sent.usage or not plan.usage_asked):
        return End.WHOLE, None
    if plan.stream and continuation.complete(plan.raw, sent):
        return End.CLOSE, None
    why = why_not_continue(plan, sent, attempt)
    return (End.CONTINUE, None) if why is None else (End.FAIL, why)


def _took(out: Outcome, res: AttemptResult) -> None:
    """What an attempt's result says of the request: its routing metadata and token counts."""
    out.info = res.info
    _counted(out, res.usage)
    if res.sample is not None:
        out.sample = res.sample


def _counted(out: Outcome, usage: dict[str, Any] | None) -> None:
    if usage:  # the completion event counts them (cost attribution: docs/security.md, observers)
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.completion_tokens = int(usage.get("completion_tokens") or 0)


def route(plan: Plan, out: Outcome) -> Flow:
    """Decide, dispatch, fail over to another node, or queue; raises the ZMLError to answer."""
    if plan.can_queue and not plan.from_queue and plan.others_waiting:
        # Others are waiting for this model: take a place behind them, do not overtake.
        out.queued = True
        yield Enqueue(saturated=False)
        return
    rr = plan.rr
    excluded: set[str] = set()
    last: AttemptError | None = None
    continuing = False  # the next attempt continues the answer a failed node began
    if plan.resumed is not None:  # its router died part-way: continue what the requester has
        end, why = ending(plan, plan.resumed, 0)
        if end in (End.WHOLE, End.CLOSE):
            out.ok = True
            out.node_id = out.continued_from[-1][0] if out.continued_from else ""
            out.attempts = plan.attempts_before
            closed = yield Close(out.node_id, plan.attempts_before,
                                 continued_from=continued_from(out.continued_from))
            assert isinstance(closed, AttemptResult)
            out.info = closed.info
            return
        if end is End.FAIL:
            raise StreamInterruptedError(f"the router relaying this stream was lost and the answer cannot be "
                                         f"continued: {why}", retry_after=1.0)
        continuing = True
    before = plan.attempts_before
    split_ok = plan.resumed is None
    for attempt in range(1, plan.max_attempts + 1):
        if excluded:  # the prompt's keys and session stay; the tried nodes are out
            rr = dataclasses.replace(rr, exclude=frozenset(excluded))
        got = yield Decide(rr, continuing, split_ok and not continuing)
        if isinstance(got, ZMLError):
            if last is not None:  # we tried nodes and they failed: say so, not "no nodes"
                break
            if isinstance(got, QueueFullError) and plan.can_queue:
                out.queued = True
                yield Enqueue(saturated=True)
                return
            raise got
        assert isinstance(got, Decision)
        decision = got
        handoff: Handoff | None = None
        refills = 0
        while decision.prefill_node:
            # Disaggregated: the prefill leg first. If it fails, another prefill node for the
            # same decode node (PREFILL_FAILOVERS), then the request whole on the decode node
            # (which can prefill too); the reply says so (no silent fallback: llm-d #2427).
            split_ok = False  # whatever happens next, a retry of this request is served whole
            leg = yield Prefill(decision, rr)
            pre = dataclasses.replace(decision, node_id=decision.prefill_node, prefill_node="")
            if isinstance(leg, Handoff):
                handoff = leg
                decision = dataclasses.replace(decision, prefill_node="")  # (the leg is done: the handoff names it)
                break
            assert isinstance(leg, AttemptError)
            failed = f"{decision.prefill_node}:{leg.failure.value}"
            out.prefill_failed = f"{out.prefill_failed},{failed}" if out.prefill_failed else failed
            if leg.failure in NODE_FAULTS:
                out.failed_nodes.append(decision.prefill_node)
            yield Penalise(pre, leg)
            excluded.add(decision.prefill_node)  # (nor a later attempt's node, whole or leg)
            decode = dataclasses.replace(decision, prefill_node="")
            if refills >= PREFILL_FAILOVERS or leg.failure is Failure.CLIENT:  # (the request's fault)
                log.warning("prefill leg on %s failed (%s %s); serving the request whole on %s",
                            decision.prefill_node, leg.failure.value, leg.detail[:200], decision.node_id)
                decision = decode
                break
            refills += 1
            rr = dataclasses.replace(rr, exclude=frozenset(excluded))
            got = yield Decide(rr, split=True, refill=decode)
            new = got if isinstance(got, Decision) and got.node_id == decode.node_id else decode
            log.warning("prefill leg on %s failed (%s %s); %s", decision.prefill_node, leg.failure.value,
                        leg.detail[:200], f"prefilling on {new.prefill_node} for {new.node_id} instead"
                        if new.prefill_node else f"serving the request whole on {new.node_id}")
            decision = new
        out.node_id, out.family, out.attempts = decision.node_id, decision.family, before + attempt
        out.info = None
        dispatch = Dispatch(decision, before + attempt, rr, plan.stream, continuing, handoff,
                            continued_from=continued_from(out.continued_from))
        res = yield dispatch
        assert isinstance(res, AttemptResult)
        _took(out, res)
        err = res.error
        if err is not None and err.stream_refused and not dispatch.whole:
            # Refused as a stream: the node may not take stream_options (an OpenAI-compatible
            # server of its own make). Asked as the caller asked, on the same node and attempt.
            log.info("node %s refused the stream (%s %s): asking it as the caller asked",
                     decision.node_id, err.status, err.detail[:200])
            res = yield dataclasses.replace(dispatch, whole=True, handoff=None)
            assert isinstance(res, AttemptResult)
            _took(out, res)
            err = res.error
        if err is None:
            out.ok = True
            return
        last = err
        end, why = ending(plan, err.sent, attempt) if err.sent is not None else (End.FAIL, None)
        if end is End.WHOLE:  # the node failed after the end of its answer: the stream is complete
            log.info("node %s failed after the end of its answer (%s): the stream is complete",
                     decision.node_id, err.detail[:120])
            out.ok = True
            _counted(out, err.usage)
            closed = yield Close(decision.node_id, before + attempt, whole=True,
                                 continued_from=dispatch.continued_from)
            assert isinstance(closed, AttemptResult)
            return
        out.node_error = err.failure in NODE_FAULTS
        if out.node_error:
            out.failed_nodes.append(decision.node_id)
        if err.failure is Failure.SLOW:
            out.slow_nodes.append(decision.node_id)
        if err.failure is Failure.CLIENT:
            if err.mid_stream:  # the engine refused the continuation, not the caller's request
                raise BackendError(f"node {decision.node_id} refused to continue the answer: {err.detail}",
                                   retry_after=1.0)
            raise BadRequestError(f"node {decision.node_id} rejected the request: {engine_error(err.status, err.detail)}")
        yield Penalise(decision, err)
        excluded.add(decision.node_id)
        if err.sent is not None:  # it failed part-way through the answer
            if end is End.CLOSE:
                out.continued_from.append((decision.node_id, err.sent.tokens, err.failure.value))
                out.ok = True
                closed = yield Close(decision.node_id, before + attempt,
                                     continued_from=continued_from(out.continued_from))
                assert isinstance(closed, AttemptResult)
                out.info = closed.info
                return
            if end is End.CONTINUE:
                continuing = True
                out.continued_from.append((decision.node_id, err.sent.tokens, err.failure.value))
                log.warning("node %s failed after %d tokens (%s %s); continuing the answer on another node",
                            decision.node_id, err.sent.tokens, err.failure.value, err.detail[:200])
                continue
            if err.mid_stream:  # part of the answer is out: it cannot start again elsewhere
                raise BackendError(f"node {decision.node_id} failed mid-stream ({err.failure.value} {err.detail}); "
                                   f"the answer cannot be continued: {why}", retry_after=1.0)
            continuing = False  # nothing went out yet: start again on another node
        elif err.mid_stream:
            raise BackendError(f"node {decision.node_id} failed mid-stream: {err.failure.value} {err.detail}",
                               retry_after=1.0)
        log.info("attempt %d on %s failed (%s %s); re-routing", attempt, decision.node_id,
                 err.failure.value, err.status)
    assert last is not None
    if last.mid_stream:
        raise BackendError(f"the answer's node failed mid-stream and no other node could continue it "
                           f"({len(excluded)} tried); last: {last.failure.value} {last.detail}".strip(),
                           retry_after=1.0)
    if last.failure is Failure.OVERLOADED and plan.can_queue:
        # Every node tried answered "overloaded": that is saturation, not a failure.
        out.queued = True
        yield Enqueue(saturated=True)
        return
    raise exhausted(plan, last, excluded)


def why_not_continue(plan: Plan, sent: Sent, attempt: int) -> str | None:
    """Why the answer a node failed part-way through cannot be continued on another (None: it
    can): the request and its policy (zml_router.answer.continuation.refusal), the attempts left, and
    the tokens left to generate."""
    if attempt >= plan.max_attempts:
        return f"no attempt left ([router] max_attempts = {plan.max_attempts})"
    why = continuation.refusal(plan.raw, asked=plan.continue_asked, policy_allows=plan.policy_continues,
                               pinned=plan.rr.accelerator_id is not None, sent=sent)
    if why is None and sent.tokens:
        left = continuation.remaining(continuation.max_asked(plan.raw), sent)
        if left is not None and left <= 0:
            why = "it had all its tokens and only its end was lost"
    return why


def exhausted(plan: Plan, last: AttemptError, tried: set[str]) -> ZMLError:
    """The error for a request whose every attempt failed (``last`` the final one)."""
    if last.failure is Failure.OVERLOADED:
        pinned = plan.rr.accelerator_id  # the node was the caller's choice, not the policy's
        return QueueFullError(
            f"node {pinned!r} is overloaded" if pinned is not None else
            f"every node tried for {plan.model!r} is overloaded ({len(tried)} tried)",
            routing_context={"policy": "pinned" if pinned is not None else plan.policy,
                             "final_error": "all_nodes_over_capacity", "nodes_tried": sorted(tried),
                             "recommendation": "increase fleet capacity or enable queue_on_saturation"},
            retry_after=last.retry_after or 1.0,
        )
    if last.failure is Failure.NO_MODEL:
        return ModelNotLoadedError(f"no node could serve model {plan.model!r}: {engine_error(last.status, last.detail)}")
    return BackendError(
        f"{len(tried)} node(s) failed for this request; last: {last.failure.value} {engine_error(last.status, last.detail)}",
        retry_after=1.0,
    )
