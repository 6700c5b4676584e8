"""A simulated node's KV-event publisher: vLLM's ``ZmqEventPublisher`` (PUB + ROUTER replay).

Each scheduler step's events go out as one ``[topic, seq, payload]`` message on the PUB socket
(seq from 0, 8 bytes big-endian; payload as vLLM 0.34 encodes it, ``zmlcore.fleet.kvevents.wire``);
the last ``buffer_steps`` are kept, and the ROUTER socket answers a replay request
``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]`` for each buffered
message from ``start_seq`` on, then ``[identity, b"", b"", -1, b""]``, as vLLM 0.34 does.

A crash of the node closes both sockets; the node coming back opens new ones whose numbering
starts again at 0 (a restarted vLLM process), which is how subscribers learn the cache is gone.

    pub = KVEventPublisher("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    await pub.start()
    engine.on_kv_events = pub.publish
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from zmlcore.fleet.kvevents.wire import Event, Layout, encode_batch, seq_bytes, seq_of

log = logging.getLogger("zml_sim")


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, layout: Layout = "0.34") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.layout: Layout = layout
        self.hwm = hwm
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        #: Messages not sent (sockets closed: the node is down).
        self.dropped = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._pub is not None

    async def start(self) -> None:
        """Bind the sockets; numbering starts at 0 (a new engine process)."""
        self.seq = 0
        self.buffer.clear()
        self._ctx = zmq.asyncio.Context()
        # A plain (blocking-API) socket: a PUB send never blocks (it drops at the high-water
        # mark), so publishing needs no await and no future on the scheduler's path.
        self._sync_ctx = zmq.Context()
        pub = self._sync_ctx.socket(zmq.PUB)
        pub.set_hwm(self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint)
        self._pub = pub
        if self.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            self._router = router
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        for ctx in (self._ctx, self._sync_ctx):
            if ctx is not None:
                ctx.term()
        self._ctx = self._sync_ctx = None

    def publish(self, events: list[Event]) -> None:
        """One scheduler step's events (the engine's ``on_kv_events``)."""
        if self._pub is None:
            self.dropped += 1
            return
        seq = self.seq
        self.seq += 1
        payload = encode_batch(time.time(), events, layout=self.layout)
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    async def _serve_replay(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("kv replay: a request of %d frames ignored", len(frames))
                continue
            ident, _, start = frames
            try:
                first = seq_of(start) if len(start) == 8 else int.from_bytes(start, "big")
            except ValueError:
                continue
            topic = (self.topic,) if self.layout == "0.34" else ()  # vLLM 0.12+ sends the topic too
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await router.send_multipart((ident, b"", *topic, seq_bytes(seq), payload))
            await router.send_multipart((ident, b"", *((b"",) if topic else ()), seq_bytes(-1), b""))
