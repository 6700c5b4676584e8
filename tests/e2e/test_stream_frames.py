"""The gateway against a stand-in router that answers in header-less stream frames
(``Zml-Accept-Stream: frames``, zmlcore.reply.streamframe): frames that queued up go out in one
write, and a hostile or garbled frame ends the stream with a clean error (an SSE error event,
or a 502 before the start), never a 500 or a dead gateway.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest

from zmlcore import subjects
from zmlcore.bus.publish import flush
from conftest import lone_gateway

MODEL = "frames/model"
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": None}]}).encode() + b"\n\n"


GOOD = [b"1\n" + _event("a"), b"2\n" + _event("b") + _event("c"), b"3\n" + _event("d")]


@pytest.fixture(scope="module")
def gateway(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_gateway(own_nats, Path(tmp_path_factory.mktemp("frames")), request_timeout_s=10) as gateway_url:
        yield gateway_url


@pytest.fixture()
async def framed_router(own_nats: str) -> AsyncIterator[dict[str, list[bytes] | bool]]:
    """Answers every stream with start, the frames the test puts in ``frames`` (header-less,
    published back to back) and, unless ``end`` is False, an end numbered after them."""
    plan: dict[str, list[bytes] | bool] = {"frames": list(GOOD), "end": True, "asked": []}
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        plan["asked"].append((msg.headers or {}).get(subjects.H_ACCEPT_STREAM))  # type: ignore[union-attr]
        rid = (msg.headers or {}).get(subjects.H_REQUEST_ID, "r")
        routing = json.dumps({"routing": {**ROUTING, "request_id": rid}}).encode()
        await nc.publish(msg.reply, routing, headers={subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
        frames = plan["frames"]
        for data in frames:  # type: ignore[union-attr]
            await nc.publish(msg.reply, data)
        if plan["end"]:
            await nc.publish(msg.reply, routing, headers={subjects.H_STREAM: subjects.STREAM_END,
                                                          subjects.H_SEQ: str(len(frames) + 1)})  # type: ignore[arg-type]

    sub = await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=serve)
    await flush(nc)
    try:
        yield plan
    finally:
        await sub.unsubscribe()
        await nc.close()


async def _sse(gateway: str) -> tuple[int, list[str]]:
    async with httpx.AsyncClient(base_url=gateway, timeout=20) as client:
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return r.status_code, [r.text]
            return r.status_code, [line async for line in r.aiter_lines() if line]


def _texts(lines: list[str]) -> list[str]:
    return [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in lines if x.startswith("data: {\"id\"")]


async def test_gateway_asks_for_frames_and_relays_them(gateway: str, framed_router: dict) -> None:  # type: ignore[type-arg]
    status, lines = await _sse(gateway)
    assert framed_router["asked"] == [subjects.STREAM_FRAMES]
    assert status == 200 and lines[-1] == "data: [DONE]", lines
    assert _texts(lines) == ["a", "b", "c", "d"]  # every event once, in order, however the writes were cut


@pytest.mark.parametrize("bad", [
    b"data: {}\n\n",                     # no sequence number
    b"x1\ndata: {}\n\n",                 # not a number
    b"-2\ndata: {}\n\n",                 # a sign
    b"\xd9\xa3\ndata: {}\n\n",           # a non-ASCII digit
    b"2 data: {}\n\n",                   # no newline after the number
    b"2\nhello",                         # not SSE events
    b"2\n",                              # nothing after the number
    b"9" * 40 + b"\ndata: {}\n\n",       # a number longer than any stream
    b"",                                 # empty
    b"\x00" * 300,                       # binary garbage
])
async def test_a_garbled_frame_ends_the_stream_with_an_error_event(gateway: str, framed_router: dict, bad: bytes) -> None:  # type: ignore[type-arg]
    framed_router["frames"] = [GOOD[0], bad, b"3\n" + _event("after")]
    status, lines = await _sse(gateway)
    assert status == 200
    assert "data: [DONE]" not in lines and _texts(lines) == ["a"], lines
    err = json.loads(lines[-1][len("data: "):])["error"]
    assert err["code"] in ("BACKEND_ERROR", "STREAM_INTERRUPTED"), err
    status, lines = await _sse_ok(gateway, framed_router)  # the gateway lives on
    assert status == 200 and lines[-1] == "data: [DONE]"


async def _sse_ok(gateway: str, plan: dict) -> tuple[int, list[str]]:  # type: ignore[type-arg]
    plan["frames"], plan["end"] = list(GOOD), True
    return await _sse(gateway)


async def test_a_lost_frame_ends_the_stream_as_interrupted(gateway: str, framed_router: dict) -> None:  # type: ignore[type-arg]
    framed_router["frames"] = [GOOD[0], GOOD[2]]  # frame 2 never comes
    framed_router["end"] = False
    status, lines = await _sse(gateway)
    assert status == 200 and _texts(lines) == ["a"], lines
    err = json.loads(lines[-1][len("data: "):])["error"]
    assert err["code"] == "STREAM_INTERRUPTED" and "2" in err["message"], err


async def test_a_frame_before_the_start_is_a_502(gateway: str, own_nats: str) -> None:
    """A raw publisher that answers with a frame and no start: a clean 502, not a 500."""
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        await nc.publish(msg.reply, b"1\n" + _event("x"))

    sub = await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=serve)
    await flush(nc)
    try:
        status, body = await _sse(gateway)
    finally:
        await sub.unsubscribe()
        await nc.close()
    assert status == 502 and json.loads(body[0])["error"]["code"] == "STREAM_INTERRUPTED", body
