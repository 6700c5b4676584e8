"""The SDK's NATS transport asks for header-less stream frames (``Zml-Accept-Stream: frames``,
zmlcore.reply.streamframe) and decodes them: several events in one frame, frames mixed with
header'd chunk messages (a router from before frames), a lost frame (STREAM_INTERRUPTED) and a
header-less message that is not a frame (BACKEND_ERROR). A scripted responder on zml.infer
plays the router on a nats-server of this module's own (no other test's subscriber on
zml.infer can answer too); the real router is covered by the SDK behaviour tests
(tests/e2e/test_sdk_client.py) over HTTP, NATS and gRPC."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import nats
import pytest

import zml
from zmlcore import subjects
from zmlcore.reply import streamframe
from zmlcore.runtime.launch import free_port, start_nats, wait_port
from zmlcore.bus.publish import flush

ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "balanced",
           "queue_depth_at_dispatch": 0, "decision_id": "d", "request_id": "r"}


def event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


def headers(kind: str, seq: int) -> dict[str, str]:
    return {subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)}


class Router:
    """Answers each request on zml.infer with the messages of ``script`` (after ``start``)."""

    def __init__(self) -> None:
        self.script: list[tuple[bytes, dict[str, str] | None]] = []
        self.seen: list[dict[str, str]] = []

    async def on(self, msg: Any) -> None:
        self.seen.append(dict(msg.headers or {}))
        nc = msg._client
        await nc.publish(msg.reply, json.dumps({"routing": ROUTING}).encode(), headers=headers("start", 0))
        for data, h in self.script:
            await nc.publish(msg.reply, data, headers=h)


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-frames-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            wait_port("127.0.0.1", port, 10)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.stop()


@pytest.fixture()
async def router(nats_url: str) -> AsyncIterator[Router]:
    nc = await nats.connect(nats_url)
    r = Router()
    sub = await nc.subscribe(subjects.INFER, queue="fake-router", cb=r.on)
    await flush(nc)
    yield r
    await sub.unsubscribe()
    await nc.close()


async def collect(url: str) -> tuple[list[str], BaseException | None]:
    texts: list[str] = []
    async with zml.AsyncClient(url, max_retries=0) as c:
        try:
            async for chunk in c.infer_stream("m", "hi", max_tokens=4):
                texts.append(chunk.text)
        except zml.ZMLError as exc:
            return texts, exc
    return texts, None


async def test_asks_for_frames_and_decodes_them(nats_url: str, router: Router) -> None:
    router.script = [
        (streamframe.encode(1, event("a") + event("b")), None),  # two events in one frame
        (json.dumps({"choices": [{"index": 0, "text": "c"}]}).encode(), headers(subjects.STREAM_CHUNK, 2)),  # pre-frames router
        (streamframe.encode(3, event("d")), None),
        (json.dumps({"routing": ROUTING}).encode(), headers(subjects.STREAM_END, 4)),
    ]
    texts, err = await collect(nats_url)
    assert err is None
    assert texts == ["a", "b", "c", "d"]
    assert router.seen[0][subjects.H_ACCEPT_STREAM] == subjects.STREAM_FRAMES


async def test_a_lost_frame_ends_the_stream_interrupted(nats_url: str, router: Router) -> None:
    router.script = [
        (streamframe.encode(1, event("a")), None),
        (streamframe.encode(3, event("c")), None),  # 2 lost
        (json.dumps({"routing": ROUTING}).encode(), headers(subjects.STREAM_END, 4)),
    ]
    texts, err = await collect(nats_url)
    assert texts == ["a"], err
    assert isinstance(err, zml.StreamInterruptedError)


@pytest.mark.parametrize("garbled", [b"data: {}\n\n", b"-1\ndata: {}\n\n", b"x" * 40, b""])
async def test_a_header_less_message_that_is_no_frame_is_a_backend_error(nats_url: str, router: Router,
                                                                        garbled: bytes) -> None:
    router.script = [
        (streamframe.encode(1, event("a")), None),
        (garbled, None),
        (json.dumps({"routing": ROUTING}).encode(), headers(subjects.STREAM_END, 3)),
    ]
    texts, err = await asyncio.wait_for(collect(nats_url), 10)
    assert texts == ["a"]
    assert isinstance(err, zml.BackendError) and not isinstance(err, zml.StreamInterruptedError)
    assert "garbled" in str(err)


async def test_bad_json_in_a_frame_is_a_backend_error(nats_url: str, router: Router) -> None:
    router.script = [
        (streamframe.encode(1, event("a") + b"data: {not json\n\n" + event("never")), None),
        (json.dumps({"routing": ROUTING}).encode(), headers(subjects.STREAM_END, 2)),
    ]
    texts, err = await collect(nats_url)
    assert texts == ["a"]
    assert isinstance(err, zml.BackendError)
