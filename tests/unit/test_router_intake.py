"""The router's intake (zml_router.request.intake and .cancel): what it does about an arriving
request before routing it (duplicate ids, a resend taking a stalled request's place, cancels
that overtook their request, id claims, which headers a sender may set). Pure: no broker, no
service, time passed in."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from zmlcore import subjects
from zmlcore.config import parse_config
from zmlcore.errors import BadRequestError, DuplicateRequestError, ReplyTooLargeError
from zmlcore.messages.keys import ApiKeyRecord
from zml_router.request.cancels import CancelBook
from zml_router.outcome import Outcome
from zml_router.request.intake import Intake, cancel, claim_key, intake

NOW = 1_000.0
CFG = parse_config({"defaults": {"request_timeout_s": 30, "max_request_timeout_s": 300},
                    "models": {"llama": {"aliases": ["ll"]}}})
INBOX = "_ZML_INBOX.UALICE.x1"  # the reply inbox of identity UALICE


@dataclass
class Msg:
    """An arriving request as the router sees it (a NATS message's fields)."""

    data: bytes
    headers: dict[str, str] | None = field(default_factory=dict)
    reply: str = INBOX
    subject: str = subjects.INFER


def _body(**extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


class Held:
    """Stands for the task of a request in flight (the service cancels what intake hands back)."""


def _intake(msg: Msg, in_flight: dict[str, Held] | None = None, cancels: CancelBook | None = None,
            from_queue: bool = False, out: Outcome | None = None, max_payload: int | None = None,
            options: dict[str, ApiKeyRecord] | None = None, now: float = NOW) -> Intake[Held]:
    return intake(msg, from_queue=from_queue, cfg=CFG, max_payload=max_payload, options=(options or {}).get,
                  in_flight=in_flight if in_flight is not None else {}, cancels=cancels or CancelBook(), now=now,
                  out=out or Outcome(), new_id=lambda: "generated")


# --- duplicate ids and resends ------------------------------------------------------------------

def test_an_id_its_owner_has_in_flight_is_a_duplicate() -> None:
    first = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}))
    in_flight = {first.key: Held()}
    with pytest.raises(DuplicateRequestError):
        _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}), in_flight)
    # The id in the body counts the same as the header.
    with pytest.raises(DuplicateRequestError):
        _intake(Msg(_body(request_id="r-1")), in_flight)


def test_ids_are_scoped_to_their_owner_and_front_door_owner() -> None:
    in_flight = {_intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"})).key: Held()}
    other_identity = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}, reply="_ZML_INBOX.UBOB.x"), in_flight)
    other_key = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1", subjects.H_OWNER: "key-2"}), in_flight)
    assert other_identity.replaces is None and other_key.replaces is None
    assert other_identity.owner == "UBOB"
    assert len({*in_flight, other_identity.key, other_key.key}) == 3


def test_a_resend_takes_the_place_of_the_stalled_request_it_repeats() -> None:
    held = Held()
    key = claim_key("UALICE", "", "r-1")
    got = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1", subjects.H_RESEND: "1"}), {key: held})
    assert got.replaces is held and got.taken_over == "self"
    assert got.resend and got.claim  # it takes the id's claim over whoever holds it


def test_a_resend_of_a_request_another_replica_held_takes_over_from_it() -> None:
    got = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1", subjects.H_RESEND: "1"}))
    assert got.replaces is None and got.taken_over == "other"


def test_a_first_request_replaces_and_takes_over_nothing() -> None:
    got = _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}))
    assert got.replaces is None and got.taken_over == "" and not got.resend and not got.cancelled


# --- cancels ------------------------------------------------------------------------------------

def test_a_cancel_for_a_request_in_flight_hands_back_its_task() -> None:
    held, book = Held(), CancelBook()
    in_flight = {claim_key("UALICE", "", "r-1"): held}
    assert cancel("zml.cancel.UALICE.r-1", None, in_flight, book, NOW) is held
    assert len(book) == 0  # nothing to remember


def test_a_cancel_that_overtakes_its_request_answers_it_cancelled_once() -> None:
    book = CancelBook(ttl_s=60)
    assert cancel("zml.cancel.UALICE.r-1", None, {}, book, NOW) is None
    msg = Msg(_body(), {subjects.H_REQUEST_ID: "r-1"})
    assert _intake(msg, cancels=book, now=NOW + 1).cancelled
    assert not _intake(msg, cancels=book, now=NOW + 2).cancelled  # taken: a later use of the id goes on


def test_a_remembered_cancel_expires() -> None:
    book = CancelBook(ttl_s=60)
    cancel("zml.cancel.UALICE.r-1", None, {}, book, NOW)
    assert not _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}), cancels=book, now=NOW + 61).cancelled


def test_a_cancel_names_only_its_own_owners_requests() -> None:
    held, book = Held(), CancelBook()
    in_flight = {claim_key("UALICE", "", "r-1"): held}
    assert cancel("zml.cancel.UBOB.r-1", None, in_flight, book, NOW) is None  # Bob cannot cancel Alice's
    assert not _intake(Msg(_body(), {subjects.H_REQUEST_ID: "r-1"}), cancels=book).cancelled
    # The front door's owner narrows it further (a gateway cancels for one API key).
    in_flight = {claim_key("", "key-1", "r-2"): held}
    assert cancel("zml.cancel.r-2", {subjects.H_OWNER: "key-1"}, in_flight, book, NOW) is held
    assert cancel("zml.cancel.r-2", {subjects.H_OWNER: "key-2"}, in_flight, book, NOW) is None


def test_a_subject_that_is_no_cancel_is_ignored() -> None:
    book = CancelBook()
    assert cancel("zml.cancel.a.b.c", None, {}, book, NOW) is None
    assert len(book) == 0


# --- id claims across replicas -------------------------------------------------------------------

@pytest.mark.parametrize(("headers", "body", "claim"), [
    ({subjects.H_REQUEST_ID: "mine"}, {}, True),  # chosen by the caller
    ({}, {"request_id": "mine"}, True),
    ({}, {}, False),  # none: generated here, unique by construction
    ({subjects.H_REQUEST_ID: "g-1", subjects.H_ID_GENERATED: "1"}, {}, False),  # generated by its sender
])
def test_only_an_id_the_caller_chose_is_claimed(headers: dict[str, str], body: dict[str, str], claim: bool) -> None:
    got = _intake(Msg(_body(**body), headers))
    assert got.claim is claim
    assert got.request_id == (headers.get(subjects.H_REQUEST_ID) or body.get("request_id") or "generated")


def test_a_queued_request_carries_its_claim_and_keeps_the_router_only_header() -> None:
    headers = {subjects.H_REQUEST_ID: "mine", subjects.H_ID_CLAIM: "42"}
    got = _intake(Msg(_body(), headers), from_queue=True)
    assert not got.claim and headers[subjects.H_ID_CLAIM] == "42"


# --- which headers a sender may set --------------------------------------------------------------

def test_front_door_headers_grant_nothing_on_zml_infer() -> None:
    headers = {subjects.H_LABEL: "team-a", subjects.H_DEFAULT_POLICY: "cost", subjects.H_ID_CLAIM: "9",
               subjects.H_BODY: subjects.BODY_CLEAN, subjects.H_POLICY: "cost", subjects.H_PREFIX_KEYS: "0 0 "}
    out = Outcome()
    got = _intake(Msg(_body(), headers), out=out)
    assert out.label == "" and got.req.routing is None and not got.clean
    assert headers == {}  # dropped from the message: they do not travel on into the saturation queue


def test_the_front_door_sets_label_and_default_policy() -> None:
    headers = {subjects.H_LABEL: "team-a", subjects.H_DEFAULT_POLICY: "cost", subjects.H_ID_CLAIM: "9"}
    out = Outcome()
    got = _intake(Msg(_body(), headers, subject=subjects.FRONT_DOOR_INFER), out=out)
    assert out.label == "team-a" and got.req.routing == "cost"
    assert subjects.H_ID_CLAIM not in headers  # router-only, from every sender


def test_an_identity_sharing_an_api_keys_plan_gets_that_keys_options() -> None:
    record = ApiKeyRecord(id="k1", sha256="h", default_policy="cost", label="team-b")
    out = Outcome()
    got = _intake(Msg(_body(), {}, subject=subjects.INFER), out=out, options={"UALICE": record})
    assert out.label == "team-b" and got.req.routing == "cost"
    # A policy the request names wins over the default.
    got = _intake(Msg(_body(policy="latency")), options={"UALICE": record})
    assert got.req.routing is None and got.req.policy == "latency"


# --- the rest of what intake reads ----------------------------------------------------------------

def test_alias_timeout_and_keepalive() -> None:
    got = _intake(Msg(_body(model="ll"), {subjects.H_TIMEOUT_MS: "2500", subjects.H_KEEPALIVE: "1000"}))
    assert got.model == "llama" and got.req.model == "ll"  # the node gets the name it knows, the client its own
    assert got.timeout == 2.5 and got.keepalive == 1.0
    assert _intake(Msg(_body())).timeout == 30 and _intake(Msg(_body())).keepalive is None
    with pytest.raises(BadRequestError):  # over the deployment's cap
        _intake(Msg(_body(), {subjects.H_TIMEOUT_MS: "300001"}))


def test_what_is_known_before_a_refusal_reaches_the_error_reply() -> None:
    out = Outcome()
    with pytest.raises(BadRequestError):
        _intake(Msg(_body(stream=True), {subjects.H_REQUEST_ID: "r-9", subjects.H_KEEPALIVE: "soon"}), out=out)
    assert out.request_id == "r-9" and out.stream  # the error goes out as a stream error, logged with its id
    with pytest.raises(BadRequestError):
        _intake(Msg(b"{not json"), out=(out := Outcome()))
    assert out.request_id == "" and not out.stream


def test_a_reply_its_requester_could_not_receive_is_refused_at_once() -> None:
    msg = Msg(_body(max_tokens=100_000))
    with pytest.raises(ReplyTooLargeError):
        _intake(msg, max_payload=64 * 1024)
    _intake(msg)  # no reply subject to check (fire and forget)
    _intake(Msg(_body(max_tokens=100_000), {subjects.H_ACCEPT_PARTS: "8388608"}), max_payload=64 * 1024)


def test_sessions_are_named_per_caller_and_fall_back_to_the_user_field() -> None:
    from zmlcore import subjects
    from zmlcore.messages import InferRequest
    from zml_router.request import prepare
    req = InferRequest(model="m", prompt="hi", user="u-7")
    assert prepare.session_of({subjects.H_SESSION: "conv-1"}, req) == "conv-1"
    assert prepare.session_of({}, req) == "u-7"
    assert prepare.session_of(None, InferRequest(model="m", prompt="hi")) == ""
    assert prepare.session_of({subjects.H_SESSION: "x" * 999}, req) == "x" * subjects.MAX_SESSION_ID
    a = prepare.session_owner("GW", {subjects.H_OWNER: "key-a"})
    b = prepare.session_owner("GW", {subjects.H_OWNER: "key-b"})
    assert a != b and prepare.session_owner("GW", None) != a


def test_prefix_chain_only_for_prompts_of_a_key_block_or_more() -> None:
    import msgspec

    from zmlcore.messages import InferRequest
    from zmlcore.policy.prefix import BLOCK_BYTES, prompt_keys
    from zml_router.request import prepare
    short = InferRequest(model="m", messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert prepare.prefix_chain("m", short, b"x" * 100) is None
    msgs = [{"role": "system", "content": "s" * 3000}, {"role": "user", "content": "q"}]
    raw = msgspec.json.encode({"model": "m", "messages": msgs})
    full = msgspec.json.decode(raw, type=InferRequest)
    chain = prepare.prefix_chain("m", full, raw)
    assert chain is not None and chain.keys == prompt_keys("m", messages=msgs).keys and len(chain) >= 3000 // BLOCK_BYTES


def test_prefix_chain_of_a_front_door_request_reads_its_raw_messages() -> None:
    import msgspec

    from zmlcore import subjects
    from zmlcore.messages import frontdoor
    from zmlcore.policy.prefix import prompt_keys
    from zml_router.request import prepare
    msgs = [{"role": "system", "content": "t" * 2000}, {"role": "user", "content": "q"}]
    raw = msgspec.json.encode({"model": "m", "messages": msgs})
    req = frontdoor.decode(raw, {subjects.H_BODY: subjects.BODY_CLEAN})
    assert isinstance(req.messages, msgspec.Raw)  # left undecoded by the front door
    chain = prepare.prefix_chain("m", req, raw)
    assert chain is not None and chain.keys == prompt_keys("m", messages=msgs).keys


def test_prefix_chain_takes_the_front_doors_keys_and_checks_them() -> None:
    """A front door's ``Zml-Prefix-Keys`` stands for the prompt (nothing decoded again); one for
    another model, or malformed, or whose key count its length cannot have, is recomputed."""
    import msgspec

    from zmlcore import subjects
    from zmlcore.messages import frontdoor
    from zmlcore.policy.prefix import KeyChain, chain_header, prompt_keys
    from zml_router.request import prepare
    msgs = [{"role": "system", "content": "t" * 5000}, {"role": "user", "content": "q"}]
    raw = msgspec.json.encode({"model": "m", "messages": msgs})
    req = frontdoor.decode(raw, {subjects.H_BODY: subjects.BODY_CLEAN})
    want = prompt_keys("m", messages=msgs)
    # a chain that differs from the prompt's shows which one was taken
    other = KeyChain([k ^ 1 for k in want.keys], want.nbytes)
    got = prepare.prefix_chain("m", req, raw, {subjects.H_PREFIX_KEYS: chain_header(other, "m")})
    assert got == other
    for bad in (chain_header(other, "another-model"), "zz 1 AAAA", "00000000 5000", "",
                chain_header(KeyChain(other.keys[:-1], other.nbytes), "m"),  # one key short for its length
                chain_header(other, "m")[:-4]):
        assert prepare.prefix_chain("m", req, raw, {subjects.H_PREFIX_KEYS: bad}) == want, bad
