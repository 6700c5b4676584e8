"""The KV-event bridge: each node's engine KV-cache events, from its ZMQ sockets into NATS.

Per node with ``[nodes.kv_events]`` in zml.toml, one task holds a SUB socket on the engine's
PUB endpoint and a DEALER on its replay endpoint, puts the stream in order
(``zmlcore.fleet.kvevents.sequence``: gaps are replayed, a restart or a loss becomes a clear),
decodes vLLM's msgpack (``zmlcore.fleet.kvevents.wire``, both layouts) and publishes each batch as a
``KvEventBatch`` on ``zml.node.kvevents.<node_id>``, where every router applies it to its prefix
index. It runs in the health service (docs/routing.md says why): the active health replica
already owns the node list, including nodes registered at run time, and a standby that takes
over asks each engine's replay socket for what it buffered.

    bridges = Bridges(publish)        # publish(subject, data) -> awaitable
    bridges.start(node_config)        # a task per node with kv_events
    bridges.status("h100-1")          # "live", "replaying", "down: ...", "" (none)
    await bridges.stop_all()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from zmlcore import subjects
from zmlcore.config import NodeConfig
from zmlcore.fleet.kvevents.sequence import Deliver, Ordering, Replay, Reset
from zmlcore.fleet.kvevents.wire import Batch, Cleared, Removed, Stored, WireError, decode_batch, seq_bytes, split_pub, split_replay
from zmlcore.messages.kvcache import KvAllCleared, KvBlockRemoved, KvBlockStored, KvEvent, KvEventBatch
from zmlcore.telemetry.metrics import Children

log = logging.getLogger("zml.health.kvbridge")

#: A replay that has not ended after this long is given up (held messages are released, the
#: missing range counted as lost).
REPLAY_TIMEOUT_S = 2.0

Publish = Callable[[str, bytes], Awaitable[None]]

BATCHES = Children(Counter(
    "zml_prefix_cache_event_batches",
    "Engine KV-event batches the health service bridged into NATS, by node and how: live, replayed, "
    "reset (events lost or the engine restarted: the node's cache state is cleared), bad (undecodable).",
    ["node", "result"]))

_encode = msgspec.json.encode


def to_nats(node_id: str, seq: int, batch: Batch, model: str) -> KvEventBatch:
    """ZML's wire form of one engine batch (token ids are left out: the index counts blocks)."""
    events: list[KvEvent] = []
    block_size = 0
    for ev in batch.events:
        if isinstance(ev, Stored):
            block_size = ev.block_size or block_size
            events.append(KvBlockStored(block_hashes=list(ev.hashes), parent_block_hash=ev.parent,
                                        block_size=ev.block_size, medium=ev.medium))
        elif isinstance(ev, Removed):
            events.append(KvBlockRemoved(block_hashes=list(ev.hashes), medium=ev.medium))
        else:
            events.append(KvAllCleared())
    return KvEventBatch(node_id=node_id, events=events, seq=seq, ts=batch.ts, block_size=block_size,
                        model=model, dp_rank=batch.dp_rank)


class KVBridge:
    """One node's bridge (see the module docstring)."""

    def __init__(self, node: NodeConfig, publish: Publish, ctx: zmq.asyncio.Context, *,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        assert node.kv_events is not None
        self.node_id = node.id
        self.cfg = node.kv_events
        self.model = node.models[0] if len(node.models) == 1 else ""
        self.publish = publish
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        self.order = Ordering(can_replay=self.cfg.replay_endpoint is not None)
        self.status = "down: not connected yet"
        self._connected = False
        self._replay_deadline: float | None = None

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.cfg.endpoint)
        dealer = None
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if self.cfg.replay_endpoint is not None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.cfg.replay_endpoint)
            poller.register(dealer, zmq.POLLIN)
        try:
            while True:
                timeout = None
                if self._replay_deadline is not None:
                    timeout = max(0, int((self._replay_deadline - time.monotonic()) * 1000))
                ready = dict(await poller.poll(timeout))
                if monitor in ready:
                    await self._on_monitor(monitor)
                if sub in ready:
                    await self._drain(sub, dealer, live=True)
                if dealer is not None and dealer in ready:
                    await self._drain(dealer, dealer, live=False)
                if self._replay_deadline is not None and time.monotonic() >= self._replay_deadline:
                    log.warning("node %s: KV-event replay unanswered after %.1f s", self.node_id,
                                self.replay_timeout_s)
                    await self._act(self.order.replay_done(), dealer)
        finally:
            sub.disable_monitor()
            for sock in (monitor, sub, dealer):
                if sock is not None:
                    sock.close(linger=0)

    async def _on_monitor(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            self._connected = event == zmq.EVENT_CONNECTED
            self._set_status()

    def _set_status(self) -> None:
        if not self._connected:
            self.status = f"down: no connection to {self.cfg.endpoint}"
        elif self.order.replaying is not None:
            self.status = "replaying"
        else:
            self.status = "live"

    async def _drain(self, sock: zmq.asyncio.Socket, dealer: zmq.asyncio.Socket | None, *, live: bool) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                seq, payload = split_pub(frames) if live else split_replay(frames)
            except WireError as exc:
                BATCHES(self.node_id, "bad").inc()
                log.warning("node %s: a KV-event message ignored: %s", self.node_id, exc)
                continue
            actions = self.order.live(seq, payload) if live else self.order.replayed(seq, payload)
            await self._act(actions, dealer, replayed=not live)

    async def _act(self, actions: list[Deliver | Replay | Reset], dealer: zmq.asyncio.Socket | None, *,
                   replayed: bool = False) -> None:
        for action in actions:
            if isinstance(action, Deliver):
                try:
                    batch = decode_batch(action.payload)
                except WireError as exc:
                    # Undecodable events are lost events: clearing is the safe state.
                    BATCHES(self.node_id, "bad").inc()
                    log.warning("node %s: KV-event batch %d undecodable (%s): clearing its cache state",
                                self.node_id, action.seq, exc)
                    batch = Batch(ts=time.time(), events=[Cleared(reason="undecodable")])
                BATCHES(self.node_id, "replayed" if replayed else "live").inc()
                await self.publish(subjects.kv_events(self.node_id),
                                   _encode(to_nats(self.node_id, action.seq, batch, self.model)))
            elif isinstance(action, Replay):
                assert dealer is not None
                await dealer.send_multipart([b"", seq_bytes(action.start)])
                self._replay_deadline = time.monotonic() + self.replay_timeout_s
            else:
                BATCHES(self.node_id, "reset").inc()
                log.info("node %s: KV cache state cleared: %s", self.node_id, action.reason)
                await self.publish(subjects.kv_events(self.node_id), _encode(KvEventBatch(
                    node_id=self.node_id, events=[KvAllCleared()], ts=time.time(), model=self.model)))
        if self.order.replaying is None:
            self._replay_deadline = None
        self._set_status()


class Bridges:
    """Every node's bridge, started and stopped with the node's polling."""

    def __init__(self, publish: Publish) -> None:
        self.publish = publish
        self._ctx: zmq.asyncio.Context | None = None
        self._bridges: dict[str, KVBridge] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, node: NodeConfig) -> None:
        if node.kv_events is None or node.id in self._tasks:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        bridge = self._bridges[node.id] = KVBridge(node, self.publish, self._ctx)
        self._tasks[node.id] = asyncio.create_task(self._run(bridge), name=f"kvbridge-{node.id}")

    async def _run(self, bridge: KVBridge) -> None:
        while True:
            try:
                await bridge.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broker hiccup on publish: log, rebuild the sockets
                log.warning("node %s: KV-event bridge failed (%s); restarting it", bridge.node_id, exc)
                bridge.status = f"down: {type(exc).__name__}"
                bridge.order = Ordering(can_replay=bridge.cfg.replay_endpoint is not None)
                await asyncio.sleep(1.0)

    async def stop(self, node_id: str) -> None:
        task = self._tasks.pop(node_id, None)
        self._bridges.pop(node_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop_all(self) -> None:
        for node_id in list(self._tasks):
            await self.stop(node_id)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def status(self, node_id: str) -> str:
        bridge = self._bridges.get(node_id)
        return bridge.status if bridge is not None else ""
