"""The health service: polls every node, keeps its state, streams it into the KV bucket
``zml_nodes`` (routers watch it, so a late router gets a snapshot), answers node listings."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import httpx
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.config import NodeConfig, ZMLConfig
from zmlcore.messages import NodeState
from zmlcore.natsio import nodes_kv
from zmlcore.sim.model import SimProfile
from zml_health.adapters import adapter_for
from zml_health.tracker import Tracker, health_score

log = logging.getLogger("zml.health")

_encode = msgspec.json.encode


class HealthService:
    def __init__(self, cfg: ZMLConfig) -> None:
        self.cfg = cfg
        self.nodes: dict[str, NodeConfig] = {n.id: n for n in cfg.nodes}
        self.trackers: dict[str, Tracker] = {}
        self.states: dict[str, NodeState] = {}
        self.kv: KeyValue | None = None
        self.nc: NATS | None = None
        self.http: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._subs: list[Subscription] = []
        self._sem = asyncio.Semaphore(cfg.health.max_concurrent_probes)

    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.kv = await nodes_kv(nc.jetstream())
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=self.cfg.health.max_concurrent_probes))
        # Entries for nodes no longer configured would mislead routers: remove them.
        try:
            for key in await self.kv.keys():
                if key not in self.nodes:
                    await self.kv.delete(key)
        except Exception:  # empty bucket: nats-py raises NoKeysError
            pass
        now = time.time()
        for node in self.nodes.values():
            self._start_polling(node, now)
        self._subs.append(await nc.subscribe(subjects.admin_nodes("list"), cb=self._on_list))

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.http:
            await self.http.aclose()

    def _start_polling(self, node: NodeConfig, now: float) -> None:
        self.trackers[node.id] = Tracker(started_at=now)
        self._tasks[node.id] = asyncio.create_task(self._poll_forever(node))

    async def _poll_forever(self, node: NodeConfig) -> None:
        hc = self.cfg.health
        # Spread first polls so a large fleet is not polled in lockstep.
        await asyncio.sleep(random.uniform(0, min(0.2, hc.poll_interval_s * hc.jitter)))
        while True:
            try:
                await self.poll_once(node)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("poll of %s failed", node.id)
            interval = hc.poll_interval_s
            await asyncio.sleep(interval * random.uniform(1 - hc.jitter, 1 + hc.jitter))

    async def poll_once(self, node: NodeConfig) -> NodeState:
        assert self.http is not None and self.kv is not None
        probe_fn = adapter_for(node.backend)
        async with self._sem:
            probe = await probe_fn(self.http, node.endpoint.rstrip("/"), self.cfg.health.probe_timeout_s)
        now = time.time()
        tr = self.trackers[node.id]
        status = tr.observe(probe, now, self.cfg.health)
        state = self._state(node, tr, probe, status, now)
        self.states[node.id] = state
        await self.kv.put(node.id, _encode(state))
        return state

    def _state(self, node: NodeConfig, tr: Tracker, probe: object, status: str, now: float) -> NodeState:
        from zml_health.adapters.base import Probe

        assert isinstance(probe, Probe)
        sim = node.sim
        prof = SimProfile.for_type(
            node.accelerator,
            speed=sim.speed if sim else None,
            prefill_tps=sim.prefill_tps if sim else None,
            decode_tps=sim.decode_tps if sim else None,
            max_concurrency=sim.max_concurrency if sim else None,
        )
        scale = sim.time_scale if sim else 1.0
        prev = self.states.get(node.id)
        # Keep the last known models/queue while a node is failing, so `zml nodes` shows them.
        models = probe.models if probe.ok else (prev.models if prev else [])
        running = probe.running if probe.ok else (prev.queue_running if prev else 0)
        waiting = probe.waiting if probe.ok else (prev.queue_waiting if prev else 0)
        return NodeState(
            node_id=node.id,
            accelerator_type=node.accelerator,
            family=node.effective_family,
            endpoint=node.endpoint,
            backend=node.backend,
            status=status,  # type: ignore[arg-type]
            reason=tr.reason,
            models=models,
            loading_models=[m for m in node.models if m not in models] if status == "loading" else [],
            queue_running=running,
            queue_waiting=waiting,
            max_concurrency=prof.max_concurrency,
            kv_cache_usage=probe.kv_cache_usage,
            free_memory_gib=None,
            error_rate=tr.error_rate,
            tokens_per_s=tr.tokens_per_s,
            prefill_tps=prof.prefill_tps * scale,
            decode_tps=prof.decode_tps * scale,
            health_score=health_score(tr.error_rate, running + waiting, prof.max_concurrency) if status == "up" else 0.0,
            cost_per_hour=node.effective_cost,
            last_ok=tr.last_ok,
            updated_at=now,
        )

    async def _on_list(self, msg: Msg) -> None:
        body = _encode({"nodes": [self.states[n] for n in sorted(self.states)]})
        await msg.respond(body)


