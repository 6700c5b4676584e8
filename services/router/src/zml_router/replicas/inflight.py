"""What router replicas share: in-flight counts (deltas as they change, a snapshot every
second) and node marks (cooldown, saturated), so that each replica's local table sees the
whole fleet's load. Losing one of these messages only makes a decision slightly stale: the next
snapshot repairs counts, and a mark is only ever an extension of a skip window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.bus.direct import subscribe_direct
from zmlcore.messages import InflightDelta, InflightSnapshot, RouterNodeState, RouterState, node_mark_decoder

from zml_router.replicas.cooldowns import Marks
from zml_router.replicas.deltas import DeltaWindow
from zml_router.replicas.table import NodeTable

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode
_delta_decoder = msgspec.json.Decoder(InflightDelta)
_snapshot_decoder = msgspec.json.Decoder(InflightSnapshot)
SNAPSHOT_EVERY_S = 1.0


class Sharing:
    def __init__(self, table: NodeTable, marks: Marks, router_id: str) -> None:
        self.table = table
        self.marks = marks
        self.router_id = router_id
        self.nc: NATS | None = None
        #: Called when capacity may have freed (the saturation queue's heads re-try then).
        self.freed: Callable[[], None] = lambda: None
        #: (node id, slots) a peer's requests freed there (flow control keeps them the peer's briefly)
        self.peer_freed: Callable[[str, int], None] = lambda node_id, n: None
        #: Peers that fell silent (killed): flow control forgets what they held waiting.
        self.peers_gone: Callable[[list[str]], None] = lambda router_ids: None
        #: Our deltas, summed per node over a short window before they go out.
        self.deltas: DeltaWindow | None = None
        self._replies: set[asyncio.Future[None]] = set()  # snapshots sent to a new peer

    async def start(self, nc: NATS, freed: Callable[[], None]) -> list[Subscription]:
        self.nc, self.freed = nc, freed
        self.deltas = DeltaWindow(nc, self.router_id)
        # Deltas and snapshots applied in the order a peer sent them: a delta sent after a
        # snapshot and applied before it would be undone by it (callback subscriptions, one
        # task per subject, do reorder them).
        return [await subscribe_direct(nc, subjects.INFLIGHT, self._on_delta),
                await subscribe_direct(nc, subjects.INFLIGHT_SNAPSHOT, self._on_snapshot),
                await nc.subscribe(subjects.NODE_MARKS, cb=self._on_mark)]

    # --- ours, to the peers ---------------------------------------------------------------------
    async def count(self, node_id: str, outstanding: int, pending: int) -> None:
        self.move(node_id, outstanding, pending)

    def move(self, node_id: str, outstanding: int, pending: int) -> None:
        """:meth:`count` without the coroutine (nothing in it waits)."""
        self.table.add_own(node_id, outstanding, pending)
        if outstanding < 0:
            self.freed()
        # Deltas are for peers: alone, skip them (a replica that joins learns our counts from
        # the next 1 s snapshot). Saves a NATS send per message on the hot path.
        if self.deltas is not None and self.table.peers:
            self.deltas.add(node_id, outstanding, pending)  # summed per node for 2 ms (zml_router.replicas.deltas)

    async def mark(self, node_id: str, kind: str, for_s: float, reason: str) -> None:
        """Skip a node here, and (over NATS) on every replica."""
        mark = self.marks.mark(node_id, kind, for_s, reason, time.time())
        if mark is not None and self.nc is not None:
            try:
                await self.nc.publish(subjects.NODE_MARKS, _encode(mark))
            except Exception:  # a peer learning late is no reason to fail the request
                log.debug("node mark not published", exc_info=True)

    async def publish_snapshots(self) -> None:
        """Every second: forget silent peers, and tell the others our own counts. The first at
        once: until the peers have heard one they do not count this replica, and until it has
        heard theirs it sends them no deltas (zml_router.replicas.table)."""
        while True:
            now = time.time()
            gone = self.table.expire_peers(now)
            if gone:
                self.peers_gone(gone)
                self.freed()
            await self.snapshot()
            await asyncio.sleep(SNAPSHOT_EVERY_S)

    async def snapshot(self) -> None:
        """Our own counts to the peers, in order with the deltas summed before (zml_router.replicas.deltas)."""
        if self.nc is None or not self.nc.is_connected:
            return
        now = time.time()

        def snap() -> bytes:
            return _encode(InflightSnapshot(router_id=self.router_id, ts=now, nodes=self.table.own_snapshot()))
        if self.deltas is not None:
            await self.deltas.then(subjects.INFLIGHT_SNAPSHOT, snap)
        else:
            await self.nc.publish(subjects.INFLIGHT_SNAPSHOT, snap())

    def close(self) -> None:
        if self.deltas is not None:
            self.deltas.close()

    def state(self, in_flight: int, now: float) -> RouterState:
        """This replica's view of every node (its answer to a state request)."""
        nodes = {}
        for v in self.table.nodes():
            own = self.table.own.get(v.node_id, [0, 0])
            why = self.marks.describe(v.node_id, now)
            nodes[v.node_id] = RouterNodeState(
                status=v.state.status, outstanding=v.outstanding, pending=v.pending, own=list(own),
                effective_outstanding=v.effective_outstanding(),
                cooldown_s=round(max(0.0, v.cooldown_until - now), 3),
                saturated_s=round(max(0.0, v.saturated_until - now), 3),
                state_age_s=round(now - v.state.updated_at, 3), cost_per_hour=v.state.cost_per_hour,
                cooldown_reason=why.get("cooldown_reason", ""), cooldown_by=why.get("cooldown_by", ""))
        return RouterState(router_id=self.router_id, in_flight=in_flight, nodes=nodes)

    # --- the peers', to us ----------------------------------------------------------------------
    def _on_delta(self, msg: Msg) -> None:
        try:
            d = _delta_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if d.router_id != self.router_id:
            self.table.apply_delta(d, time.time())
            if d.outstanding < 0:
                self.peer_freed(d.node_id, -d.outstanding)
                self.freed()

    def _on_snapshot(self, msg: Msg) -> None:
        try:
            snap = _snapshot_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if snap.router_id != self.router_id:
            new = snap.router_id not in self.table.peers
            self.table.apply_snapshot(snap, time.time())
            if new:  # a replica just started (or came back): it learns of us now, not in a second
                task = asyncio.ensure_future(self.snapshot())
                self._replies.add(task)
                task.add_done_callback(self._replies.discard)

    async def _on_mark(self, msg: Msg) -> None:
        try:
            mark = node_mark_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if self.marks.apply_peer(mark, time.time()):
            log.info("%s marked %s %s for %.1f s (%s)", mark.router_id, mark.node_id, mark.kind, mark.for_s,
                     mark.reason)
