"""The health service's KV-event bridge over a real nats-server: events from a simulated vLLM's
ZMQ sockets, and the engines' own bytes (vLLM 0.11.0 and 0.34.0, SGLang; tests/data/kvevents/)
from a raw ZMQ publisher, reach ``zml.node.kvevents.<node>`` in order; a gap is filled from the replay socket,
an unfillable gap and an engine restart clear the node; NodeState carries the engine's
prefix-cache geometry and hit rate."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml_health.service import HealthService
from zmlcore import subjects
from zmlcore.fleet.kvevents.wire import seq_bytes, seq_of
from zmlcore.messages.kvcache import KvAllCleared, KvBlockRemoved, KvBlockStored, KvEventBatch, kv_event_batch_decoder
from zmlcore.runtime.launch import free_port

M = "meta-llama/llama-3-8b-instruct"
DATA = Path(__file__).parents[1] / "data" / "kvevents"


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


def endpoints() -> dict[str, str]:
    return {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}


class FakeVLLM:
    """vLLM's ZmqEventPublisher reduced to its sockets: sends given payloads with given sequence
    numbers, buffers them, answers replays as ``version`` does."""

    def __init__(self, ep: dict[str, str], version: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(ep["endpoint"])
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(ep["replay_endpoint"])
        self.version = version
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=100)
        self.replays: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def send(self, seq: int, payload: bytes, *, drop: bool = False) -> None:
        self.buffer.append((seq, payload))
        if not drop:  # a dropped message is buffered but never reaches the subscriber
            await self.pub.send_multipart([b"", seq_bytes(seq), payload])

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.router.recv_multipart()
            self.replays.append(seq_of(start))
            for seq, payload in list(self.buffer):
                if seq >= seq_of(start):
                    frames = [seq_bytes(seq), payload] if self.version == "0.11.0" else [b"", seq_bytes(seq), payload]
                    await self.router.send_multipart([ident, b"", *frames])
            tail = [seq_bytes(-1), b""] if self.version == "0.11.0" else [b"", seq_bytes(-1), b""]
            await self.router.send_multipart([ident, b"", *tail])

    async def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


async def collect(nc: Any, node_id: str) -> tuple[list[KvEventBatch], Any]:
    got: list[KvEventBatch] = []

    async def on(msg: Any) -> None:
        got.append(kv_event_batch_decoder.decode(msg.data))

    sub = await nc.subscribe(subjects.kv_events(node_id), cb=on)
    return got, sub


@pytest.mark.parametrize("fixture", ["vllm-0.11.0", "vllm-0.34.0", "sglang-006d053"])
async def test_engine_bytes_bridged_in_order_with_replay_and_resets(nats_private: str, fixture: str) -> None:
    payloads = [bytes.fromhex(h) for h in json.loads((DATA / f"{fixture}.json").read_text())["payloads"]]
    ep = endpoints()
    fake = FakeVLLM(ep, "0.34.0" if fixture == "vllm-0.34.0" else "0.11.0")  # SGLang replays as vLLM 0.11
    # The node's HTTP side is a sim (health polls it); its events come from the fake publisher.
    sim = await start_sim("v1", "nvidia_h100", [M])
    svc = HealthService(config([node_entry(sim, kv_events=ep)]))
    async with connected(nats_private) as nc:
        got, sub = await collect(nc, "v1")
        await svc.start(nc)
        try:
            await eventually(lambda: svc.bridges.status("v1") == "live", what="bridge connected")
            await asyncio.sleep(0.3)  # the SUB's subscription reaches the PUB
            await fake.send(0, payloads[0])
            await eventually(lambda: len(got) == 1, what="first batch")
            b = got[0]
            assert b.seq == 0 and b.node_id == "v1" and b.model == M and b.block_size == 16
            stored = b.events[0]
            assert isinstance(stored, KvBlockStored)
            assert stored.block_hashes == [0x1234_5678_9ABC_DEF0, 0xFEDC_BA98_7654_3210]
            assert stored.parent_block_hash is None and stored.token_ids == []  # ids stay at the bridge
            # seq 1 is lost on the way, seq 2 arrives: the bridge replays 1 from the engine's buffer
            await fake.send(1, payloads[1], drop=True)
            await fake.send(2, payloads[2])
            await eventually(lambda: len(got) == 3, what="replayed batch and the held one")
            assert fake.replays == [1]
            assert [g.seq for g in got] == [0, 1, 2]
            assert isinstance(got[1].events[0], KvBlockStored) and got[1].events[0].parent_block_hash == 0xFEDC_BA98_7654_3210
            assert isinstance(got[1].events[1], KvBlockRemoved) and got[1].events[1].block_hashes == [0x1234_5678_9ABC_DEF0]
            assert isinstance(got[2].events[0], KvAllCleared)
            # a gap the engine no longer buffers: the node is cleared, then the new batch applies
            await fake.send(3, payloads[0], drop=True)
            await fake.send(4, payloads[0], drop=True)
            fake.buffer.clear()  # rolled over: 3 and 4 are gone for good
            await fake.send(5, payloads[0])
            await eventually(lambda: len(got) == 5, what="reset then batch 5")
            assert fake.replays == [1, 3]
            assert isinstance(got[3].events[0], KvAllCleared) and got[3].seq == -1
            assert got[4].seq == 5
            # the engine restarts: numbering back at 0 clears the node, then batch 0 applies
            await fake.send(0, payloads[0])
            await eventually(lambda: len(got) == 7, what="restart")
            assert isinstance(got[5].events[0], KvAllCleared) and got[6].seq == 0
            st = await eventually(lambda: (s := svc.states.get("v1")) and s.kv_events == "live" and s)
            assert st.cache_fidelity == "precise"
        finally:
            await sub.unsubscribe()
            await svc.stop()
            await sim.stop()
            await fake.close()


async def test_a_sims_events_and_prefix_cache_state(nats_private: str) -> None:
    ep = endpoints()
    sim = await start_sim("v2", "amd_mi300x", [M], kv_events=_kv(ep))
    # no calibration request: its prompt's blocks would be stored beside the ones counted here
    svc = HealthService(config([node_entry(sim, kv_events=ep)], health={"calibrate": False}))
    async with connected(nats_private) as nc:
        got, sub = await collect(nc, "v2")
        await svc.start(nc)
        try:
            await eventually(lambda: svc.bridges.status("v2") == "live", what="bridge connected")
            await asyncio.sleep(0.3)
            text = "the same long system prompt " * 60
            async with httpx.AsyncClient(timeout=30) as c:
                for _ in range(3):
                    r = await c.post(sim.url + "/v1/completions", json={"model": M, "prompt": text, "max_tokens": 2})
                    assert r.status_code == 200
            await eventually(lambda: got, what="stored events")
            stored = [e for b in got for e in b.events if isinstance(e, KvBlockStored)]
            assert stored and stored[0].block_size == 16  # MI300X's block
            assert sum(len(e.block_hashes) for e in stored) == (len(text) // 4) // 16
            st = await eventually(lambda: (s := svc.states.get("v2")) and s.prefix_cache_queries >= 3 * 420 and s)
            assert st.kv_block_size == 16 and st.kv_blocks == sim.engine.cache_capacity_blocks
            assert st.prefix_cache_hits > 0 and st.cache_fidelity == "precise"
        finally:
            await sub.unsubscribe()
            await svc.stop()
            await sim.stop()


async def test_a_node_without_kv_events_is_reported_fidelity(nats_private: str) -> None:
    sim = await start_sim("l1", "cpu", [M], engine="llamacpp")
    svc = HealthService(config([node_entry(sim)]))
    async with connected(nats_private) as nc:
        await svc.start(nc)
        try:
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"model": M, "prompt": "a prompt worth caching " * 30, "max_tokens": 2}
                for _ in range(2):
                    assert (await c.post(sim.url + "/v1/completions", json=body)).status_code == 200
            st = await eventually(lambda: (s := svc.states.get("l1")) and s.prefix_cache_hits > 0 and s)
            assert st.kv_events == "" and st.cache_fidelity == "reported" and st.kv_block_size == 1
            assert st.kv_blocks > 0
        finally:
            await svc.stop()
            await sim.stop()


def _kv(ep: dict[str, str]) -> Any:
    from zmlcore.config import KVEventsConfig

    return msgspec.convert(ep, KVEventsConfig)
