"""Intake: what the router does about an arriving request (step 1 of zml_router.request).

The headers its sender may not set, its body and id, whose it is, its timeout, and what to do
about the requests already in flight here; :func:`cancel` is the other half."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import (
    BadRequestError,
    DuplicateRequestError,
)
from zmlcore.messages import InferRequest, StreamResume, audio, frontdoor
from zmlcore.messages.keys import ApiKeyRecord
from zmlcore.messages.validate import (
    check_request_id,
    decode_request,
    request_timeout_s,
)
from zmlcore.reply import resume as resumes
from zmlcore.reply.bigreply import check_fits
from zmlcore.reply.keepalive import parse_interval

from zml_router.incoming import Incoming
from zml_router.outcome import Outcome
from zml_router.request.cancels import CancelBook

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
                   subjects.H_PREFIX_KEYS,
                   # an API key's flow options (zml keys create --priority/--max-priority/--weight)
                   subjects.H_PRIORITY_DEFAULT, subjects.H_PRIORITY_MAX, subjects.H_TENANT_WEIGHT)
#: Set only by routers, on queued requests (zml_router.replicas.ids).
ROUTER_ONLY = (subjects.H_ID_CLAIM, subjects.H_TENANT)
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
        if msg.headers is not None and (shared.priority or shared.max_priority or shared.weight != 1.0):
            # its flow options too, in place as drop_untrusted edits (zml_router.request.flowgate reads them)
            flow = {subjects.H_PRIORITY_DEFAULT: shared.priority, subjects.H_PRIORITY_MAX: shared.max_priority,
                    subjects.H_TENANT_WEIGHT: f"{shared.weight:g}"}
            msg.headers.update({k: v for k, v in flow.items() if v})
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
