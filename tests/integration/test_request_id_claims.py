"""Claims on callers' request ids (zml_router.replicas.ids) on a real broker: two RequestIds play two
router replicas; a dead holder's claim is taken over, a live one's is not, and an abandoned claim
expires by its TTL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError

from zmlcore import subjects
from zmlcore.errors import DuplicateRequestError
from zml_router.replicas import ids as idclaims
from zml_router.request.intake import claim_key
from zml_router.replicas.ids import RequestIds


@pytest.fixture()
async def conns(nats_url: str) -> AsyncIterator[list[NATS]]:
    ncs = [await nats.connect(nats_url) for _ in range(3)]
    try:
        yield ncs
    finally:
        for nc in ncs:
            await nc.close()


async def _answer(msg) -> None:  # type: ignore[no-untyped-def]
    await msg.respond(b"{}")


async def _replicas(ncs: list[NATS]) -> tuple[RequestIds, RequestIds]:
    a, b = RequestIds("router-a", 60), RequestIds("router-b", 60)
    await a.open(ncs[0])
    await b.open(ncs[1])
    return a, b


async def test_one_claim_per_key_across_replicas_and_reuse_after_release(conns: list[NATS]) -> None:
    a, b = await _replicas(conns)
    # router-a answers its state subject: it is alive.
    alive = [await conns[0].subscribe(subjects.router_state("router-a"), cb=_answer),
             await conns[1].subscribe(subjects.router_state("router-b"), cb=_answer)]
    key = claim_key("owner", "", "same")
    first = await a.claim(key, 30, "same")
    assert first is not None
    for replica in (a, b):
        with pytest.raises(DuplicateRequestError, match="same"):
            await replica.claim(key, 30, "same")
    assert await b.claim(claim_key("other-owner", "", "same"), 30, "same") is not None  # ids are per owner
    assert await b.claim(claim_key("owner", "key-2", "same"), 30, "same") is not None  # ... and per front-door owner
    await a.release(first)
    again = await b.claim(key, 30, "same")  # at once, on the other replica
    assert again is not None
    await a.release(first)  # a stale release (old revision) does not free the new holder's claim
    with pytest.raises(DuplicateRequestError):
        await a.claim(key, 30, "same")
    for sub in alive:
        await sub.unsubscribe()


async def test_a_dead_holders_claim_is_taken_over(conns: list[NATS]) -> None:
    a, b = await _replicas(conns)
    key = claim_key("owner", "", "resent")
    assert await a.claim(key, 30, "resent") is not None
    # Nobody answers zml.admin.router.router-a.state: router-a is gone (no responders).
    taken = await b.claim(key, 30, "resent")
    assert taken is not None
    alive = await conns[1].subscribe(subjects.router_state("router-b"), cb=_answer)
    with pytest.raises(DuplicateRequestError):  # and now b (alive) holds it
        await a.claim(key, 30, "resent")
    await alive.unsubscribe()


async def test_an_abandoned_claim_expires(conns: list[NATS], monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = await _replicas(conns)
    alive = await conns[2].subscribe(subjects.router_state("router-a"), cb=_answer)
    monkeypatch.setattr(idclaims, "SLACK_S", 0.0)
    key = claim_key("owner", "", "crashed")
    assert await a.claim(key, 1.0, "crashed") is not None  # TTL 1 s; never released
    kv = await conns[1].jetstream().key_value(subjects.REQUEST_IDS_BUCKET)
    t0 = time.monotonic()
    while True:
        try:
            await kv.get(idclaims.bucket_key(key))
        except KeyNotFoundError:
            break  # the server removed it
        assert time.monotonic() - t0 < 10, "the claim never expired"
        await asyncio.sleep(0.2)
    b = RequestIds("router-b", 60)
    await b.open(conns[1])
    assert await b.claim(key, 30, "crashed") is not None
    await alive.unsubscribe()


async def test_a_router_restarted_under_the_same_id_takes_over_its_last_life_claims(conns: list[NATS]) -> None:
    # `zml up` names its routers (router-1, ...) and restarts a dead one under the same name: it
    # answers the holder check, but as another incarnation, so the claims of the one that died
    # (a caller's retry of the request it was serving) are taken over at once, by it or a peer,
    # not refused for the request's timeout.
    from zmlcore.messages.router import RouterState

    def answering(incarnation: str):  # type: ignore[no-untyped-def]
        async def cb(msg) -> None:  # type: ignore[no-untyped-def]
            await msg.respond(msgspec.json.encode(RouterState(router_id="router-a", in_flight=0, nodes={},
                                                              incarnation=incarnation)))
        return cb

    dead = RequestIds("router-a", 60, incarnation="first")
    await dead.open(conns[0])
    key, other = claim_key("owner", "", "retried"), claim_key("owner", "", "retried-2")
    assert await dead.claim(key, 30, "retried") is not None
    assert await dead.claim(other, 30, "retried-2") is not None
    reborn = RequestIds("router-a", 60, incarnation="second")
    await reborn.open(conns[1])
    alive = await conns[1].subscribe(subjects.router_state("router-a"), cb=answering("second"))
    assert await reborn.claim(key, 30, "retried") is not None  # its own last life's claim
    b = RequestIds("router-b", 60, incarnation="b1")
    await b.open(conns[2])
    assert await b.claim(other, 30, "retried-2") is not None  # a peer's check asks for the incarnation
    with pytest.raises(DuplicateRequestError):  # the living incarnation's claim stands
        await b.claim(key, 30, "retried")
    await alive.unsubscribe()
