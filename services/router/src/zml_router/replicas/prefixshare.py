"""The router's prefix index, kept in step with the other replicas and the engines.

One :class:`~zmlcore.policy.prefix.PrefixIndex` per router replica, fed from three sides:

* this replica's dispatches (``recorded``) and the engines' reports on its replies
  (``corrected``), each also published on ``zml.node.prefix`` (``PrefixRecord``, gathered for a
  few milliseconds: ``zmlcore.bus.batchpub``) so that every replica learns them: N replicas
  route as one;
* the other replicas' records, applied as if made here;
* the engines' KV events bridged by the health service (``zml.node.kvevents.>``).

A prompt shorter than one key block has no keys: nothing is recorded or published for it,
so short-prompt traffic costs nothing here.

    share = PrefixShare(nc, router_id, index)
    await share.start()
    share.recorded(node_id, chain, now)                 # after dispatching
    share.corrected(node_id, chain, cached, prompt, now)  # the engine's cached tokens
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from zmlcore import subjects
from zmlcore.bus.batchpub import BatchPublisher
from zmlcore.messages.kvcache import PrefixRecord, kv_event_batch_decoder, prefix_record_decoder
from zmlcore.policy.prefix import KeyChain, PrefixIndex

log = logging.getLogger("zml.router.prefix")

#: How long records are gathered before one write (they are off the request path).
WINDOW_S = 0.005

EVENTS = Counter("zml_prefix_cache_index_updates",
                 "Updates applied to this router's prefix index, by source: dispatch and report "
                 "(this replica), peer_dispatch and peer_report (other replicas), kv_events (engines).",
                 ["source"])
_DISPATCH, _REPORT = EVENTS.labels("dispatch"), EVENTS.labels("report")
_PEER_DISPATCH, _PEER_REPORT = EVENTS.labels("peer_dispatch"), EVENTS.labels("peer_report")
_KV_EVENTS = EVENTS.labels("kv_events")

_encode = msgspec.json.encode


class PrefixShare:
    def __init__(self, nc: NATS, router_id: str, index: PrefixIndex, *,
                 clock: Callable[[], float] = time.time, window_s: float = WINDOW_S) -> None:
        self.nc = nc
        self.router_id = router_id
        self.index = index
        self.clock = clock
        self.pub = BatchPublisher(nc, subjects.PREFIX_RECORDS, window_s)
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        self.pub.start()
        self._subs.append(await self.nc.subscribe(subjects.PREFIX_RECORDS, cb=self._on_record))
        self._subs.append(await self.nc.subscribe(subjects.KV_EVENTS_PREFIX + ".>", cb=self._on_events))

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is closing
                pass
        self._subs.clear()
        await self.pub.stop()

    def recorded(self, node_id: str, chain: KeyChain | None, now: float) -> None:
        """This replica dispatched ``chain`` to ``node_id``."""
        if chain is None or not chain.keys:
            return
        self.index.record(node_id, chain, now)
        _DISPATCH.inc()
        self.pub.add(_encode(PrefixRecord(router_id=self.router_id, node_id=node_id, keys=chain.to_bytes(),
                                          nbytes=chain.nbytes, ts=now)))

    def corrected(self, node_id: str, chain: KeyChain | None, cached_tokens: int, prompt_tokens: int,
                  now: float) -> None:
        """The engine reported ``cached_tokens`` of the request's ``prompt_tokens`` cached."""
        if chain is None or not chain.keys:
            return
        self.index.correct(node_id, chain, cached_tokens, now, prompt_tokens)
        _REPORT.inc()
        self.pub.add(_encode(PrefixRecord(router_id=self.router_id, node_id=node_id, keys=chain.to_bytes(),
                                          nbytes=chain.nbytes, ts=now, cached_tokens=cached_tokens,
                                          prompt_tokens=prompt_tokens)))

    async def _on_record(self, msg: Msg) -> None:
        try:
            rec = prefix_record_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if rec.router_id == self.router_id or len(rec.keys) % 8:
            return
        chain = KeyChain.from_bytes(rec.keys, rec.nbytes)
        now = self.clock()
        if rec.cached_tokens < 0:
            self.index.record(rec.node_id, chain, now)
            _PEER_DISPATCH.inc()
        else:
            self.index.correct(rec.node_id, chain, rec.cached_tokens, now, rec.prompt_tokens)
            _PEER_REPORT.inc()

    async def _on_events(self, msg: Msg) -> None:
        try:
            batch = kv_event_batch_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.index.apply_events(batch.node_id, batch, self.clock())
        _KV_EVENTS.inc()
