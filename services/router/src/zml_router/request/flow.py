"""One request's way through the router, as sans-I/O steps: no NATS, no HTTP, time passed in.

The service (``zml_router.service``) does the I/O; every rule of what happens to a request is
here, unit-tested without a broker or a node:

1. :func:`intake` reads an arriving request: the headers its sender may not set dropped
   (:func:`drop_untrusted`), its body and id, whose it is, its timeout, and what to do about the
   requests already in flight here: a second request with an id its owner
   has in flight is DUPLICATE_REQUEST_ID, unless its requester sent it again because this
   router looked dead (``Zml-Resend``: it takes the first one's place), and a request whose
   cancel overtook it is answered CANCELLED. :func:`cancel` is the other half: a cancel for a
   request in flight here, or one to remember (``zml_router.request.cancels``).
2. :func:`prepare` resolves the request's policy and what the policies see of it (``RouteRequest``).
3. :func:`route` decides, dispatches, fails over to another node or queues. Its model is httpx's
   ``auth_flow``: a generator that yields what should happen next and receives how it went:

   - :class:`Decide` -> the :class:`~zmlcore.policy.Decision` (``zmlcore.policy.admit``: choose_node
     under the admission bound), or the ZMLError it raised;
   - :class:`Dispatch` -> ``None`` once the node's answer went out to the requester, or the
     :class:`~zml_router.node.attempt.AttemptError` of a failed attempt; a node that fails part-way
     through the answer is followed by a *continuation* on another node where
     ``zml_router.answer.continuation.refusal`` allows it (``Decide``/``Dispatch`` with
     ``continuation``: only nodes whose engine can continue an answer, and the rest of it);
   - :class:`Penalise` -> ``None`` (the node was marked here and for the peers);
   - :class:`Enqueue` -> nothing: the request waits in the saturation queue, the flow is over;
   - :class:`Close` -> ``None``: the requester has every token of the answer and lost only its
     end (its node failed, or its router died, after the last one): the stream is ended here.

   It returns once the answer is out (``out.ok``) or the request queued (``out.queued``); an
   error the requester gets is raised as the ZMLError to reply with.

       flow = route(plan, out)
       action = next(flow)
       while True:                 # see RouterService._route
           result = do(action)     # decide / dispatch / penalise / enqueue
           action = flow.send(result)

4. :func:`completion` is the event of a finished request, :func:`penalty` how a failed attempt
   marks its node.

Which node serves is policy (``zmlcore.policy``: choose_node, the admission bound); what an
attempt on that node sends and gets is ``zml_router.node.attempt``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, Union

import msgspec

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import (
    BackendError,
    BadRequestError,
    DuplicateRequestError,
    ModelNotLoadedError,
    QueueFullError,
    StreamInterruptedError,
    TimeoutError,
    ZMLError,
)
from zmlcore.messages import InferRequest, RoutingInfo, StreamResume, audio, frontdoor
from zmlcore.messages.audio import AudioRequest
from zmlcore.messages.keys import ApiKeyRecord
from zmlcore.messages.validate import check_request_id, decode_request, request_timeout_s
from zmlcore.messages.warmup import RequestCompleted
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest, resolve_policy
from zmlcore.policy.estimate import prompt_tokens_from_body
from zmlcore.policy.prefix import KeyChain, chain_from_header, keyed, request_keys
from zmlcore.reply.bigreply import check_fits
from zmlcore.reply.engineerror import engine_error
from zmlcore.reply import resume as resumes
from zmlcore.reply.keepalive import parse_interval

from zml_router.answer import continuation
from zml_router.node.attempt import AttemptError, Failure
from zml_router.request.cancels import CancelBook
from zml_router.incoming import Incoming
from zml_router.node.result import PATHS, Dispatch, Handoff
from zml_router.outcome import Outcome
from zmlcore.reply.transcript import Sent

log = logging.getLogger("zml.router")

#: Failures that are the node's fault: it is cooled down and counted as a node error.
NODE_FAULTS = (Failure.NETWORK, Failure.SERVER, Failure.SLOW)

T = TypeVar("T")
_decode_any = msgspec.json.Decoder()


# --- which request headers a sender may set ----------------------------------------------------
# A front door (the gateway) authenticates its callers and passes an API key's options to the
# router as headers: ``Zml-Label`` (cost attribution, in routing metadata and completion events)
# and ``Zml-Default-Policy``. Anyone may publish ``zml.infer``, so there these headers are
# dropped: a raw NATS client's label and default policy come from its own record (an identity
# sharing an API key's plan gets that key's, zml_router.replicas.limits) or are empty. Only the gateway
# role may publish :data:`zmlcore.subjects.FRONT_DOOR_INFER` (zmlcore.access.permissions), and
# only there are they honoured; so are ``Zml-Body: clean`` and the ZML fields the gateway moved
# out of a validated body (``Zml-Policy``, ``Zml-Accelerator-Id``): on ``zml.infer`` the body is
# decoded and checked in full, and a header cannot set what the body could not. On an open
# broker (no identities) anyone can publish there: docs/security.md.
#
# The other request headers need no trust: ``Zml-Owner``, ``Zml-Request-Id`` and
# ``Zml-Id-Generated`` only narrow or affect the sender's own namespace (owner = the identity of
# its reply inbox), and ``Zml-Timeout-Ms`` is bounded like the body's ``timeout_ms``. Router-only
# headers (a queued request's claim on its id) are dropped from every sender.

#: Honoured only from a front door.
FRONT_DOOR_ONLY = (subjects.H_LABEL, subjects.H_DEFAULT_POLICY,
                   # A body the gateway validated, its ZML fields in headers (zmlcore.messages.frontdoor):
                   # elsewhere they come from the body, checked in full.
                   subjects.H_BODY, subjects.H_POLICY, subjects.H_ACCELERATOR_ID,
                   # the prompt's key chain as the front door computed it: another sender's could
                   # make this router record prefixes on nodes that never saw them
                   subjects.H_PREFIX_KEYS)
#: Set only by routers, on queued requests (zml_router.replicas.ids).
ROUTER_ONLY = (subjects.H_ID_CLAIM,)
#: An audio request's routing fields are headers whichever way it comes (its multipart form is
#: never rewritten): from anyone, they are checked as a JSON body's would be, and set nothing a
#: body could not (zmlcore.messages.audio.from_message).
FRONT_DOOR_ONLY_AUDIO = tuple(h for h in FRONT_DOOR_ONLY if h not in (subjects.H_POLICY, subjects.H_ACCELERATOR_ID))


def drop_untrusted(msg: Incoming) -> None:
    """Drop from ``msg``'s headers (in place: a request that waits in the saturation queue
    keeps its headers) those its sender may not set."""
    headers = msg.headers
    if not headers:
        return
    drop: tuple[str, ...]
    if msg.subject == subjects.FRONT_DOOR_INFER:
        drop = ROUTER_ONLY
    else:
        drop = ROUTER_ONLY + (FRONT_DOOR_ONLY_AUDIO if subjects.H_AUDIO in headers else FRONT_DOOR_ONLY)
    for name in drop:
        headers.pop(name, None)


# --- intake: what the router does about an arriving request ------------------------------------
def _new_id() -> str:
    return os.urandom(8).hex()


def claim_key(owner: str, front_door_owner: str, request_id: str) -> str:
    """An owner's request id, as the router keys its requests, cancels and id claims: the
    identity owning the reply inbox, narrowed by a front door's ``Zml-Owner`` (which can only
    split the sender's own namespace further). Ids are scoped to owners: another caller's ids
    never clash."""
    return f"{owner}\x00{front_door_owner}\x00{request_id}"


def owner_key(reply: str, headers: Mapping[str, str], request_id: str) -> str:
    """:func:`claim_key` of a request with this reply subject and headers."""
    return claim_key(subjects.reply_owner(reply), headers.get(subjects.H_OWNER, ""), request_id)


@dataclass(slots=True)
class Intake(Generic[T]):
    """An arriving request, read, and what the router does about it before routing it."""

    req: InferRequest
    #: Validated by the gateway, ZML's fields in headers (zmlcore.messages.frontdoor).
    clean: bool
    model: str  # resolved from an alias
    request_id: str
    owner: str  # the identity owning the reply inbox ("" on an open broker)
    key: str  # claim_key: how its in-flight entry, cancels and id claim are found
    timeout: float
    #: Seconds between keepalives its requester asked for (zmlcore.reply.keepalive), or None.
    keepalive: float | None
    #: Sent again by its requester because the router holding it went silent (``Zml-Resend``).
    resend: bool
    #: The request in flight here that this one replaces (a resend), to cancel.
    replaces: T | None
    #: Where the request it takes over was: "self" (this replica, stalled), "other", or "".
    taken_over: str
    #: Take a claim on its id across replicas (zml_router.replicas.ids): an id its caller chose.
    claim: bool
    #: A cancel for it arrived first: answer CANCELLED.
    cancelled: bool
    #: A stream whose router died part-way, sent again with what its requester has of the
    #: answer (``Zml-Resume``: zmlcore.reply.resume): continued from there, not started again.
    resume: StreamResume | None = None


def intake(msg: Incoming, *, from_queue: bool, cfg: ZMLConfig, max_payload: int | None,
           options: Callable[[str], ApiKeyRecord | None], in_flight: Mapping[str, T], cancels: CancelBook,
           now: float, out: Outcome, new_id: Callable[[], str] = _new_id) -> Intake[T]:
    """Read an arriving request and decide what to do about it (raises the ZMLError to answer).

    ``max_payload``: the largest message its requester can receive (None: no reply to check);
    ``options``: the API key record whose options an identity shares (zml_router.replicas.limits);
    ``in_flight``: the requests this replica holds, by :func:`claim_key`; a cancel remembered in
    ``cancels`` is taken (forgotten) here. ``out`` gets the request id and stream flag as soon as
    they are known, for the error reply. ``from_queue``: the request comes out of the saturation
    queue, where the router that took it in put it (its headers were filtered then)."""
    if not from_queue:
        drop_untrusted(msg)
    headers = msg.headers or {}
    depth = cfg.defaults.max_json_depth
    clean = headers.get(subjects.H_BODY) == subjects.BODY_CLEAN
    req: InferRequest
    if subjects.H_AUDIO in headers:  # a multipart form, read in full on both subjects, never rewritten
        req, clean = audio.from_message(msg.data, headers), True
    elif clean:
        req = frontdoor.decode(msg.data, headers, max_depth=depth)
    else:
        req = decode_request(msg.data, max_depth=depth)
    out.stream = req.stream
    request_id = out.request_id = check_request_id(headers.get(subjects.H_REQUEST_ID) or req.request_id or new_id())
    model = cfg.resolve_model(req.model)
    if max_payload is not None:  # a reply the requester could not receive: refuse now
        mc = cfg.models.get(model)
        check_fits(msg.data, req, headers, max_payload, mc.max_model_len if mc else None)
    # The gateway passes the API key's options: its default policy, its cost label. An identity
    # sharing a key's plan gets that key's (its own headers cannot override them).
    owner = subjects.reply_owner(msg.reply)
    shared = options(owner)
    if shared is not None:
        headers = {**headers, subjects.H_DEFAULT_POLICY: shared.default_policy, subjects.H_LABEL: shared.label}
    if req.policy is None and req.routing is None and headers.get(subjects.H_DEFAULT_POLICY):
        req.routing = headers[subjects.H_DEFAULT_POLICY]
    out.label = headers.get(subjects.H_LABEL, "")[:200]
    timeout = request_timeout_s(req.timeout_ms, headers.get(subjects.H_TIMEOUT_MS),
                                cfg.defaults.request_timeout_s, cfg.defaults.max_request_timeout_s)
    key = claim_key(owner, headers.get(subjects.H_OWNER, ""), request_id)
    keepalive = parse_interval(headers.get(subjects.H_KEEPALIVE))
    resend = bool(headers.get(subjects.H_RESEND))
    held = in_flight.get(key)
    if held is not None and not resend:
        raise DuplicateRequestError(f"request_id {request_id!r} is already in flight for this caller")
    # Sent again because this replica looked dead (stalled): its first attempt answers an inbox
    # nobody reads any more. This one replaces it.
    taken_over = ("self" if held is not None else "other") if resend else ""
    # Ids generated by a sender (or by us) are unique by construction: no claim. A queued
    # request carries the claim taken where it arrived.
    claim = (not from_queue and bool(headers.get(subjects.H_REQUEST_ID) or req.request_id)
             and headers.get(subjects.H_ID_GENERATED) != "1")
    resume = None
    if subjects.H_RESUME in headers:
        if not req.stream:
            raise BadRequestError(f"{subjects.H_RESUME} continues a streamed answer: this request is not streamed")
        resume = resumes.decode(headers[subjects.H_RESUME])
    return Intake(req, clean, model, request_id, owner, key, timeout, keepalive, resend, held, taken_over, claim,
                  cancels.take(key, now), resume)


def cancel(subject: str, headers: Mapping[str, str] | None, in_flight: Mapping[str, T], cancels: CancelBook,
           now: float) -> T | None:
    """A cancel message: the request in flight here to cancel, or None (then it is remembered in
    ``cancels``: its request has not arrived yet, or waits in the saturation queue). The owner is
    the subject token that permissions pin to the sender's identity: a cancel for another
    owner's request id names a different key and matches nothing."""
    parsed = subjects.parse_cancel(subject)
    if parsed is None:
        return None
    owner, request_id = parsed
    key = claim_key(owner, (headers or {}).get(subjects.H_OWNER, ""), request_id)
    held = in_flight.get(key)
    if held is None:
        cancels.add(key, now)
    return held


# --- the request's policy, and its way through the fleet -----------------------------------------
def check_kind(cfg: ZMLConfig, model: str, req: InferRequest) -> None:
    """Raise BadRequestError when a configured model cannot answer this kind of request.

    Chat, completions and embeddings share ``zml.infer``; the request's fields say its kind
    (``messages``, ``prompt`` or ``input``) and ``[models."X"] embedding`` says what a configured
    model is, so a chat request for an embedding model (or the reverse) is a clear 400 here
    instead of whatever the engine makes of it."""
    mc = cfg.models.get(model)
    if mc is None:
        return  # not configured: the node decides
    if isinstance(req, AudioRequest) != mc.audio:
        if mc.audio:
            raise BadRequestError(f"model {model!r} is a speech-to-text model: use POST /v1/audio/transcriptions "
                                  "or /v1/audio/translations")
        raise BadRequestError(f"model {model!r} is not a speech-to-text model (zml.toml: [models] audio = false)")
    if mc.audio:
        return
    embedding = req.input is not None
    if embedding and not mc.embedding:
        raise BadRequestError(f"model {model!r} is not an embedding model (zml.toml: [models] embedding = false)")
    if mc.embedding and not embedding:
        raise BadRequestError(f"model {model!r} is an embedding model: use POST /v1/embeddings (`input`)")


def prefix_chain(model: str, req: InferRequest, raw: bytes, headers: Mapping[str, str] | None = None) -> KeyChain | None:
    """The prompt's key chain (``zmlcore.policy.prefix``), or None for a prompt too short to hold
    one key block. A front door sends the chain it computed from the prompt it decoded anyway
    (``Zml-Prefix-Keys``, honoured from a front door only: drop_untrusted); else the prompt is
    decoded here (a front door leaves it raw) and keyed."""
    if not keyed(len(raw), req.input is not None):
        return None
    given = headers.get(subjects.H_PREFIX_KEYS) if headers else None
    if given is not None:
        chain = chain_from_header(given, model)
        if chain is not None:
            return chain
    msgs: Any = req.messages
    prompt: Any = req.prompt
    try:
        if isinstance(msgs, msgspec.Raw):
            msgs = _decode_any.decode(msgs) if msgs else None
        if isinstance(prompt, msgspec.Raw):
            prompt = _decode_any.decode(prompt) if prompt else None
    except msgspec.DecodeError:
        return None
    return request_keys(model, msgs, prompt)


def session_owner(owner: str, headers: Mapping[str, str] | None) -> str:
    """Whose session names these are: the identity owning the reply inbox and, behind a front
    door, its caller (``Zml-Owner``: the API key or client address), so that two callers'
    "conv-1" are two sessions."""
    return f"{owner}\x00{(headers or {}).get(subjects.H_OWNER, '')}"


def session_of(headers: Mapping[str, str] | None, req: InferRequest) -> str:
    """The request's session: ``Zml-Session`` (``x-session-id``, the SDK's ``session=``), else
    the OpenAI ``user`` field; "" for none."""
    if headers:
        s = headers.get(subjects.H_SESSION)
        if s:
            return s[:subjects.MAX_SESSION_ID]
    return (req.user or "")[:subjects.MAX_SESSION_ID]


def prepare(cfg: ZMLConfig, families: list[str], req: InferRequest, raw: bytes,
            model: str, session_node: str | None = None,
            headers: Mapping[str, str] | None = None) -> tuple[ResolvedPolicy, RouteRequest]:
    """The policy of a request for ``model`` (its name resolved from an alias: ``cfg.resolve_model``)
    and what the policies see of it (errors: bad policy/kind): its size, its prompt's key chain
    (``headers``: the request's, for a front door's chain) and the node its session is bound to."""
    per_call = req.policy if req.policy is not None else req.routing
    # Chains may name families registered at run time, not only zml.toml's.
    policy = resolve_policy(cfg, model, per_call, families)
    check_kind(cfg, model, req)
    # An embedding is a prefill and no decode: one "output token" for the estimate.
    max_tokens = 1 if req.input is not None else req.max_tokens or req.max_completion_tokens or 512
    # ~4 bytes per token of JSON body: good enough for a TTFT estimate, and O(1). Audio: the
    # encoder's frames for its duration (its bytes say nothing of it).
    prompt = req.audio_tokens() if isinstance(req, AudioRequest) else prompt_tokens_from_body(len(raw))
    rr = RouteRequest(model=model, prompt_tokens=prompt, max_tokens=max_tokens,
                      accelerator_id=req.accelerator_id, prefix=prefix_chain(model, req, raw, headers),
                      session_node=session_node)
    return policy, rr


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


@dataclass(slots=True)
class Decide:
    rr: RouteRequest
    #: Only nodes whose engine can continue an answer (zml_router.answer.continuation.engine_continues).
    continuation: bool = False
    #: The decision may split the request into a prefill leg and a decode leg
    #: (zmlcore.policy.split); not after a split attempt of it failed, nor for a continuation.
    split: bool = True


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


@dataclass(slots=True)
class Close:
    """The requester has the whole answer and lost only its end (zml_router.answer.continuation.complete):
    end the stream here, as its node would have; nothing is asked of a node. The flow is over."""

    #: The node that produced the answer (and failed, or whose router died, after it).
    node_id: str
    attempts: int


Action = Union[Decide, Prefill, Dispatch, Penalise, Enqueue, Close]
#: What the service sends back: a Decision or ZMLError for Decide, a Handoff or AttemptError for
#: Prefill, None or AttemptError otherwise.
Result = Union[Decision, ZMLError, AttemptError, Handoff, None]
Flow = Generator[Action, Result, None]


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
        if plan.stream and continuation.complete(plan.raw, plan.resumed):
            out.ok = True
            yield Close(out.continued_from[-1][0] if out.continued_from else "", plan.attempts_before)
            return
        why = why_not_continue(plan, plan.resumed, 0)
        if why is not None:
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
        if decision.prefill_node:
            # Disaggregated: the prefill leg first; if it fails, the request is served whole
            # on the decode node (which can prefill too), and the reply says so (no silent
            # fallback: llm-d #2427).
            split_ok = False  # whatever happens next, a retry of this request is served whole
            leg = yield Prefill(decision, rr)
            pre = dataclasses.replace(decision, node_id=decision.prefill_node, prefill_node="")
            if isinstance(leg, Handoff):
                handoff = leg
            else:
                assert isinstance(leg, AttemptError)
                out.prefill_failed = f"{decision.prefill_node}:{leg.failure.value}"
                if leg.failure in NODE_FAULTS:
                    out.failed_nodes.append(decision.prefill_node)
                log.warning("prefill leg on %s failed (%s %s); serving the request whole on %s",
                            decision.prefill_node, leg.failure.value, leg.detail[:200], decision.node_id)
                yield Penalise(pre, leg)
            decision = dataclasses.replace(decision, prefill_node="")
        out.node_id, out.family, out.attempts = decision.node_id, decision.family, before + attempt
        out.info = None
        err = yield Dispatch(decision, before + attempt, rr, plan.stream, continuing, handoff)
        if err is None:
            out.ok = True
            return
        assert isinstance(err, AttemptError)
        last = err
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
            if plan.stream and continuation.complete(plan.raw, err.sent):
                out.continued_from.append((decision.node_id, err.sent.tokens, err.failure.value))
                out.ok = True
                yield Close(decision.node_id, before + attempt)
                return
            why = why_not_continue(plan, err.sent, attempt)
            if why is None:
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


def deadline_passed(timeout_s: float) -> TimeoutError:
    """The request's own deadline passed while it was being routed or served."""
    return TimeoutError(f"request exceeded its timeout of {timeout_s:g} s")


def queue_expired(waited_ms: int) -> QueueFullError:
    """A queued request whose deadline passed before any node had room."""
    return QueueFullError(
        f"no node had room within max_queue_ms (waited {waited_ms} ms)",
        routing_context={"final_error": "queue_timeout", "waited_ms": waited_ms,
                         "recommendation": "increase fleet capacity or max_queue_ms"},
        retry_after=1.0,
    )


def penalty(err: AttemptError, saturated_s: float, cooldown_s: float) -> tuple[str, float] | None:
    """How a failed attempt marks its node: (kind, seconds), or None for no mark."""
    if err.failure is Failure.OVERLOADED:
        # "Retry-After: 0" from an overloaded node would mean "hammer me": use the default.
        return "saturated", err.retry_after or saturated_s
    if err.failure in NODE_FAULTS:
        return "cooldown", err.retry_after if err.retry_after is not None else cooldown_s
    return None


def completion(out: Outcome, now: float, latency_s: float, router_id: str) -> RequestCompleted:
    """The event of a finished request (warmup measures demand, health counts node errors).
    A request that failed on its last node blames that node as ``node_id``; the others it
    failed on before are ``failed_nodes``."""
    info = out.info
    node_error = not out.ok and out.node_error
    failed = out.failed_nodes[:-1] if node_error else out.failed_nodes
    return RequestCompleted(
        model=out.model, node_id=out.node_id, family=out.family, ok=out.ok, error_code=out.error_code,
        node_error=node_error, failed_nodes=failed, ts=now,
        ttft_s=info.time_to_first_token if info is not None and out.ok else None,
        latency_s=latency_s, attempts=out.attempts, router_id=router_id,
        request_id=out.request_id, slow_nodes=out.slow_nodes, label=out.label,
        prompt_tokens=out.prompt_tokens if out.ok else 0, completion_tokens=out.completion_tokens if out.ok else 0,
        speed=out.sample if out.ok else None,
    )
