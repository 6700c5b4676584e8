"""Issue 8 item 7 and issue 20 item 3 with a real broker restart: nats-server is killed (-9)
and restarted while a stream is half-way, and a chunk is published while it is down (it may be
lost, or arrive before the requester is subscribed again). The caller never gets a silently
short completion, and now not an error either: when its connection is back the requester (the
gateway, the SDK's NATS transport) sends the request again with what it received
(``Zml-Resume``), and the router continues the stream from there, numbering on: every chunk
once and [DONE]. (Before, the gateway ended every stream the broker blinked under with
STREAM_INTERRUPTED, and the SDK reported the gap when the chunk was lost.)

The stream comes from a stand-in router (this test's own subscriber, numbering its messages as
the router does and continuing a ``Zml-Resume`` as it does) so that the moment of the kill is
exact; the gateway and the SDK are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest

import zml
from zmlcore import subjects
from zmlcore.reply import resume
from zmlcore.runtime.launch import Proc, free_port, start_nats
from zmlcore.bus.publish import flush
from conftest import lone_gateway

MODEL = "restart/model"
WORDS = ["w1 ", "w2 ", "w3 ", "w4 "]
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}
CHUNKS = [json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                      "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}).encode()
          for w in WORDS]


class Broker:
    def __init__(self, store: str) -> None:
        self.port = free_port()
        self.store = store
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: Proc = start_nats("127.0.0.1", self.port, store)

    def kill9_and_restart(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.stop()  # reaps it
        self.proc = start_nats("127.0.0.1", self.port, self.store)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    b = Broker(str(tmp_path_factory.mktemp("nats-restart")))
    try:
        yield b
    finally:
        b.proc.stop()


@pytest.fixture(scope="module")
def gateway(broker: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_gateway(broker.url, Path(tmp_path_factory.mktemp("gw-restart")), request_timeout_s=15) as gateway_url:
        yield gateway_url


class StandIn:
    """Answers one stream: start and w1 at once, w2 while the broker is down, then w3, w4 and
    end once the test says the broker is back."""

    def __init__(self) -> None:
        self.nc: nats.NATS | None = None
        self.sent_first = asyncio.Event()
        self.broker_down = asyncio.Event()
        self.broker_back = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    async def on_request(self, msg) -> None:  # type: ignore[no-untyped-def]
        value = (msg.headers or {}).get(subjects.H_RESUME)
        serve = self._serve(msg.reply) if value is None else self._continue(msg.reply, resume.decode(value))
        task = asyncio.create_task(serve)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, reply: str, seq: int, kind: str, data: bytes) -> None:
        assert self.nc is not None
        await self.nc.publish(reply, data, headers={subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)})

    async def _continue(self, reply: str, r: resume.StreamResume) -> None:
        """What a router does with a stream sent again: the rest after what the requester has,
        numbered on from its last message, no second start."""
        assert r.text == "".join(WORDS[:r.tokens]), r  # what the requester has, exactly
        seq = r.seq
        for chunk in CHUNKS[r.tokens:]:
            seq += 1
            await self._send(reply, seq, subjects.STREAM_CHUNK, chunk)
        await self._send(reply, seq + 1, subjects.STREAM_END, json.dumps({"routing": ROUTING}).encode())

    async def _serve(self, reply: str) -> None:
        routing = json.dumps({"routing": ROUTING}).encode()
        chunks = CHUNKS
        await self._send(reply, 0, "start", routing)
        await self._send(reply, 1, subjects.STREAM_CHUNK, chunks[0])
        await flush(self.nc)  # type: ignore[union-attr]
        self.sent_first.set()
        await self.broker_down.wait()
        await self._send(reply, 2, subjects.STREAM_CHUNK, chunks[1])  # into the outage
        await self.broker_back.wait()
        await self._send(reply, 3, subjects.STREAM_CHUNK, chunks[2])
        await self._send(reply, 4, subjects.STREAM_CHUNK, chunks[3])
        await self._send(reply, 5, subjects.STREAM_END, routing)


@pytest.fixture()
async def stand_in(broker: Broker) -> AsyncIterator[StandIn]:
    s = StandIn()
    s.nc = await nats.connect(broker.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    for subject in (subjects.INFER, subjects.FRONT_DOOR_INFER):  # the SDK's and the gateway's
        await s.nc.subscribe(subject, queue=subjects.ROUTER_QUEUE, cb=s.on_request)
    await flush(s.nc)
    try:
        yield s
    finally:
        for t in list(s.tasks):
            t.cancel()
        await s.nc.close()


async def _restart_mid_stream(broker: Broker, s: StandIn, ready_url: str | None = None) -> None:
    await asyncio.wait_for(s.sent_first.wait(), 15)
    await asyncio.sleep(0.3)  # w1 relayed
    await asyncio.to_thread(broker.kill9_and_restart)
    s.broker_down.set()
    for _ in range(100):  # both sides back on the new server
        ok = s.nc is not None and s.nc.is_connected
        if ok and ready_url:
            try:
                async with httpx.AsyncClient(timeout=2) as c:
                    ok = (await c.get(ready_url + "/healthz")).status_code == 200
            except httpx.HTTPError:
                ok = False
        if ok:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    s.broker_back.set()


async def test_gateway_stream_across_a_broker_restart_is_complete(
        broker: Broker, gateway: str, stand_in: StandIn) -> None:
    async def client() -> list[str]:
        async with httpx.AsyncClient(base_url=gateway, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
                assert r.status_code == 200
                return [line async for line in r.aiter_lines() if line]

    task = asyncio.create_task(client())
    await _restart_mid_stream(broker, stand_in, gateway)
    lines = await asyncio.wait_for(task, 30)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"]
                   for line in lines if line.startswith("data: {") and "choices" in line)
    assert lines[-1] == "data: [DONE]" and text == "".join(WORDS), lines  # every chunk once


async def test_sdk_nats_stream_across_a_broker_restart_is_complete(
        broker: Broker, stand_in: StandIn) -> None:
    got: list[str] = []
    async with zml.AsyncClient(endpoint=broker.url, model=MODEL, max_retries=0, timeout=10) as client:
        async def read() -> None:
            async with client.infer_stream(prompt="hi") as stream:
                async for chunk in stream:
                    got.append(chunk.text)

        task = asyncio.create_task(read())
        await _restart_mid_stream(broker, stand_in)
        await asyncio.wait_for(task, 30)
    assert "".join(got) == "".join(WORDS), got  # every chunk once, never short
