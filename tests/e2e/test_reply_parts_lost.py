"""A reply sent in parts that loses one on the bus (issue 9): a clean, retryable error
(REPLY_INCOMPLETE) at the gateway and in the SDK's NATS transport, never a truncated body.

A stand-in router (the test's own subscriber in the routers' queue group, on a broker of this
module's own) answers each request with a reply in parts, as the router does for a reply over
max_payload (zmlcore.reply.bigreply.split), except that it skips the parts the test names, as a broker
restart does to at-most-once messages. The real router's parts: tests/e2e/test_big_replies.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest

import zml
from zmlcore import subjects
from zmlcore.reply import parts
from zmlcore.reply.bigreply import split
from zmlcore.bus.publish import flush
from conftest import lone_gateway

MODEL = "parts/model"
TEXT = "x" * 9000
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}


@pytest.fixture(scope="module")
def gateway(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_gateway(own_nats, Path(tmp_path_factory.mktemp("parts")), request_timeout_s=10) as gateway_url:
        yield gateway_url


@pytest.fixture()
async def parts_router(own_nats: str) -> AsyncIterator[list[int]]:
    """Answers every request with a ~9 kB chat completion in 10 parts of 1,000 bytes, but never
    sends the part numbers in ``skip`` (a list the test fills)."""
    skip: list[int] = []
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        headers = msg.headers or {}
        assert headers.get(subjects.H_ACCEPT_PARTS, "").isdigit(), headers  # the requester declares parts
        rid = headers.get(subjects.H_REQUEST_ID, "r")
        body = json.dumps({"id": "c", "object": "chat.completion", "model": MODEL,
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 9000, "total_tokens": 9001},
                           "zml": {**ROUTING, "request_id": rid}}).encode()
        for data, h in split(body, {subjects.H_REQUEST_ID: rid, subjects.H_NODE_ID: "n1"}, 1000):
            if int(h[subjects.H_PART]) not in skip:
                await nc.publish(msg.reply, data, headers=h)

    # The gateway sends on the front-door subject, the SDK on zml.infer: stand in on both.
    subs = [await nc.subscribe(s, queue=subjects.ROUTER_QUEUE, cb=serve)
            for s in (subjects.INFER, subjects.FRONT_DOOR_INFER)]
    await flush(nc)
    try:
        yield skip
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


async def _chat(gateway: str) -> httpx.Response:  # async: the stand-in router runs on this loop
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(gateway + "/v1/chat/completions",
                                 json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


async def test_gateway_answers_502_reply_incomplete_when_a_part_is_lost(gateway: str, parts_router: list[int]) -> None:
    r = await _chat(gateway)  # control: every part arrives, the whole body
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == TEXT, r.text[:300]
    parts_router.append(4)
    r = await _chat(gateway)
    assert r.status_code == 502, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "REPLY_INCOMPLETE" and "part 4 of 10" in err["message"], err
    assert len(r.content) < 1000  # an error, not the 3 parts that came before the gap


async def test_sdk_raises_reply_incomplete_for_a_lost_part(own_nats: str, parts_router: list[int]) -> None:
    async with zml.AsyncClient(endpoint=own_nats, model=MODEL, max_retries=0) as client:
        assert (await client.infer(prompt="hi")).text == TEXT
        parts_router.append(2)
        with pytest.raises(zml.ReplyIncompleteError) as err:
            await client.infer(prompt="hi")
    assert err.value.code == "REPLY_INCOMPLETE" and err.value.retryable


async def test_sdk_does_not_wait_the_whole_timeout_for_a_lost_last_part(
        own_nats: str, parts_router: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parts, "PART_WAIT_S", 0.5)
    parts_router.append(10)
    async with zml.AsyncClient(endpoint=own_nats, model=MODEL, timeout=20, max_retries=0) as client:
        t0 = time.monotonic()
        with pytest.raises(zml.ReplyIncompleteError) as err:
            await client.infer(prompt="hi")
    assert err.value.code == "REPLY_INCOMPLETE" and "part 10 of 10" in err.value.message
    assert time.monotonic() - t0 < 10  # not the 20 s request timeout
