"""The health service: polls every node, keeps its state, streams it into the KV bucket
``zml_nodes`` (routers watch it: a late router gets a snapshot), validates hardware, and serves
run-time registration (``zml.admin.nodes.add|remove|list``, persisted in ``zml_registry``).

Per poll of a node: engine adapter probe -> node probe (hardware, loading models, free memory)
-> tracker (status, rates, error rate) -> hardware check -> NodeState -> KV put when it changed
meaningfully or the heartbeat is due (see ``publish``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx
import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.config import NodeConfig, ZMLConfig, parse_config, with_choices
from zmlcore.errors import BadRequestError, ConfigError, ZMLError
from zml_health.hardware import HardwareCheck, validate_hardware
from zml_health.score import health_score
from zml_health.served import engine_names, match_loras, mismatch_note, split_models
from zmlcore.bus.direct import subscribe_direct
from zmlcore.bus.kvfollow import live_keys
from zmlcore.bus.link import link_of
from zmlcore.messages import NodeMark, NodeState, node_state_decoder
from zmlcore.messages.node import RECOVERED
from zmlcore.messages.admin import (
    NodeAdded,
    NodeRemoved,
    NodeSpec,
    RegistryEntry,
    node_add_decoder,
    node_remove_decoder,
    registry_entry_decoder,
)
from zmlcore.messages.warmup import completion_counts_decoder, warmup_event_decoder
from zmlcore.policy.estimate import fold_adapter_load_s
from zmlcore.bus.ensure import ensure_kv, nodes_kv
from zmlcore.runtime.runner import cancel_and_wait
from zmlcore.fleet.perfmodel import SimProfile
from zml_health import metrics, nodeprobe
from zml_health.adapters import adapter_for, llamacpp, sglang
from zml_health.adapters.base import Probe
from zml_health.kvbridge import Bridges
from zml_health.calibrate import calibrate
from zml_health.publish import Writes, effective_heartbeat
from zml_health.speedbook import SpeedBook
from zml_health.tracker import Tracker

log = logging.getLogger("zml.health")

_encode = msgspec.json.encode
#: Re-check a node that had no probe endpoint every this many polls (an agent may start later).
NO_PROBE_RECHECK = 12
#: A node whose learned estimate moved (SpeedBook.moved) is polled and its state written this
#: soon after its last poll began at the earliest, instead of a whole poll interval later.
REPUBLISH_MIN_S = 1.0


def spec_to_config(spec: NodeSpec) -> NodeConfig:
    """Validate a run-time node exactly as zml.toml would (raises ConfigError)."""
    cfg = parse_config({"nodes": [msgspec.to_builtins(spec)]}, source="zml.admin.nodes.add", whole_fleet=False)
    return cfg.nodes[0]


class _NodeRuntime:
    """What the service keeps per node besides its tracker."""

    __slots__ = ("doc", "has_probe", "probe_checked_at", "pending_loads", "warmed", "calibration", "draining",
                 "failed_at", "loras", "model_loras", "adapter_load_s", "moved")

    def __init__(self) -> None:
        self.doc: dict[str, Any] | None = None
        #: None: not known yet; False: the node has no probe endpoint.
        self.has_probe: bool | None = None
        self.probe_checked_at = 0
        #: model -> deadline: loads the warmup service started (not routable for the model).
        self.pending_loads: dict[str, float] = {}
        #: Models warmup was asked to load here (`zml serve --nodes`): the fleet's, configured or not.
        self.warmed: set[str] = set()
        #: The calibration request in flight, if any (one per node at a time).
        self.calibration: asyncio.Task[None] | None = None
        #: When a router last reported the node failing or slow (completion events): routers cool
        #: it down; a real request answered after that lifts their cooldown (_recover).
        self.failed_at = 0.0
        #: model -> deadline: models the placement planner is moving off this node (not routable).
        self.draining: dict[str, float] = {}
        #: llama.cpp: the --lora files of the engine as it runs now (None: not read since it
        #: started; read once per start, zml_health.adapters.llamacpp).
        self.loras: list[llamacpp.Lora] | None = None
        #: llama.cpp router mode: each model's --lora files (engine name -> paths, in id order),
        #: as its last listing said (Probe.model_loras); None: not router mode.
        self.model_loras: dict[str, list[str]] | None = None
        #: Seconds warmup's adapter loads here took, a moving mean (0: none measured yet).
        self.adapter_load_s = 0.0
        #: Set when the node's learned estimate moved enough to publish it before the next poll
        #: (zml_health.speedbook.SpeedBook.moved).
        self.moved = asyncio.Event()


class HealthService:
    def __init__(self, cfg: ZMLConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.config_nodes: dict[str, NodeConfig] = {n.id: n for n in cfg.nodes}
        self.nodes: dict[str, NodeConfig] = dict(self.config_nodes)
        self.sources: dict[str, str] = {n: "config" for n in self.nodes}
        self.trackers: dict[str, Tracker] = {}
        self.runtime: dict[str, _NodeRuntime] = {}
        self.states: dict[str, NodeState] = {}
        self.kv: KeyValue | None = None
        self.registry: KeyValue | None = None
        self.nc: NATS | None = None
        self.http: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._subs: list[Subscription] = []
        self._sem = asyncio.Semaphore(cfg.health.max_concurrent_probes)
        self._admin_lock = asyncio.Lock()
        #: which polled states go to the KV bucket (on change, else as a heartbeat)
        self.writes = Writes(effective_heartbeat(cfg.health.kv_heartbeat_s, cfg.router.stale_after_s))
        self._link_gen = 0
        #: The fleet's models (_known_models), and the registrations they were made from.
        self._known: tuple[int, frozenset[str]] | None = None
        self._registry_gen = 0
        #: Each node's KV-event bridge (nodes with [nodes.kv_events]), started with its polling.
        self.bridges = Bridges(self._publish)
        #: Every node's learned speeds (routers' samples, counters, calibration requests).
        self.speeds = SpeedBook()
        sglang.GENERATE_EVERY = cfg.health.generate_probe_every

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        self.nc = nc
        js = nc.jetstream()
        # A state put that is not acknowledged within about a poll is stale anyway; the next poll
        # puts a fresh one (after a broker restart, a put sent before JetStream was back is lost).
        self.kv = await nodes_kv(nc.jetstream(timeout=min(5.0, max(1.0, 2 * self.cfg.health.poll_interval_s))))
        self.registry = await ensure_kv(js, subjects.REGISTRY_BUCKET)
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=self.cfg.health.max_concurrent_probes))
        await self._load_registry()
        # Entries for nodes no longer registered would mislead routers: remove them.
        for key in await live_keys(self.kv, nc):
            if key not in self.nodes:
                await self.kv.delete(key)
        previous = await self._previous_states()
        now = self.clock()
        for node in self.nodes.values():
            self._start_polling(node, now)
            # a restart or a standby taking over: go on from the speeds the fleet was routed on
            # (no estimate back to the type's default, no node calibrated again for it)
            st = previous.get(node.id)
            if st is not None and st.endpoint == node.endpoint and st.model_speeds:
                self.speeds.adopt(node.id, st.model_speeds)
        for verb, cb in (("list", self._on_list), ("add", self._on_add), ("remove", self._on_remove)):
            self._subs.append(await nc.subscribe(subjects.admin_nodes(verb), cb=cb))
        # One event per request of every router: taken in nats-py's reader, no task switch each
        # (zmlcore.bus.direct; the handler only updates counters).
        self._subs.append(await subscribe_direct(nc, subjects.event(subjects.EVENT_COMPLETED), self._on_completed))
        self._subs.append(await nc.subscribe(subjects.event(subjects.EVENT_WARMUP), cb=self._on_warmup))

    async def _previous_states(self) -> dict[str, NodeState]:
        """The last state the bucket holds of each node still registered."""
        assert self.kv is not None and self.nc is not None
        out: dict[str, NodeState] = {}
        for key in await live_keys(self.kv, self.nc):
            if key not in self.nodes:
                continue
            try:
                entry = await self.kv.get(key)
                out[key] = node_state_decoder.decode(entry.value or b"")
            except Exception as exc:  # an unreadable state is one to learn again, not a failed start
                log.info("previous state of %s not read: %s", key, exc)
        return out

    async def _publish(self, subject: str, data: bytes) -> None:
        if self.nc is not None:
            await self.nc.publish(subject, data)

    async def stop(self) -> None:
        await self.bridges.stop_all()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closing
                pass
        await cancel_and_wait(self._tasks.values())
        if self.http:
            await self.http.aclose()

    async def _load_registry(self) -> None:
        assert self.registry is not None and self.nc is not None
        self._registry_gen += 1
        for key in await live_keys(self.registry, self.nc):
            try:
                entry = await self.registry.get(key)
                reg = registry_entry_decoder.decode(entry.value or b"")
            except Exception as exc:  # a bad entry must not stop the service
                log.warning("registry entry %s unreadable: %s", key, exc)
                continue
            if reg.removed:
                self.nodes.pop(key, None)
                self.sources.pop(key, None)
            elif reg.node is not None:
                try:
                    self.nodes[key] = spec_to_config(reg.node)
                    self.sources[key] = "registry"
                except ConfigError as exc:
                    log.warning("registry entry %s invalid: %s", key, exc)

    # --- polling ---------------------------------------------------------------------------
    def _start_polling(self, node: NodeConfig, now: float) -> None:
        hc = self.cfg.health
        grace = node.startup_grace_s if node.startup_grace_s is not None else hc.startup_grace_s
        self.trackers[node.id] = Tracker(started_at=now, grace_s=grace, history_len=hc.history_len)
        prof = self._profile(node)
        self.speeds.forget(node.id)
        self.speeds.prior(node.id, node.accelerator, prefill_tps=prof.prefill_tps, decode_tps=prof.decode_tps)
        self.runtime[node.id] = _NodeRuntime()
        self._tasks[node.id] = asyncio.create_task(self._poll_forever(node), name=f"poll-{node.id}")
        self.bridges.start(node)

    async def _stop_polling(self, node_id: str) -> None:
        task = self._tasks.pop(node_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.bridges.stop(node_id)
        self.trackers.pop(node_id, None)
        rt = self.runtime.pop(node_id, None)
        if rt is not None and rt.calibration is not None:
            rt.calibration.cancel()
        self.speeds.forget(node_id)
        self.states.pop(node_id, None)
        self.writes.forget(node_id)

    async def _poll_forever(self, node: NodeConfig) -> None:
        hc = self.cfg.health
        # Spread first polls over one interval so a large fleet is not polled in lockstep.
        await asyncio.sleep(random.uniform(0, hc.poll_interval_s * max(hc.jitter, 0.05)))
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            if (rt := self.runtime.get(node.id)) is not None:
                rt.moved.clear()  # this poll publishes what moved so far
            try:
                await self.poll_once(node)
            except asyncio.CancelledError:
                raise
            except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
                # A slow broker (or a starved box) is not a bug: no traceback, the next poll retries.
                log.warning("poll of %s: NATS timed out (%s); retrying at the next poll", node.id, type(exc).__name__)
            except Exception:
                log.exception("poll of %s failed", node.id)
            await self._rest(node.id, hc.poll_interval_s * random.uniform(1 - hc.jitter, 1 + hc.jitter), started)

    async def _rest(self, node_id: str, wait_s: float, started: float) -> None:
        """Until the node's next poll: ``wait_s``, or sooner when its learned estimate moved
        (SpeedBook.moved), though not within REPUBLISH_MIN_S of the last one's start."""
        rt = self.runtime.get(node_id)
        if rt is None:
            await asyncio.sleep(wait_s)
            return
        loop = asyncio.get_running_loop()
        planned = loop.time() + wait_s
        try:
            await asyncio.wait_for(rt.moved.wait(), wait_s)
        except TimeoutError:
            return
        # never later than planned (a poll interval under REPUBLISH_MIN_S stays as it is)
        await asyncio.sleep(max(0.0, min(started + REPUBLISH_MIN_S, planned) - loop.time()))

    async def poll_once(self, node: NodeConfig) -> NodeState:
        assert self.http is not None and self.kv is not None
        hc = self.cfg.health
        tr = self.trackers[node.id]
        rt = self.runtime[node.id]
        probe_fn = adapter_for(node.backend)
        endpoint = node.endpoint.rstrip("/")
        t0 = time.perf_counter()
        async with self._sem:
            probe = await probe_fn(self.http, endpoint, hc.probe_timeout_s, tr.polls)
            if not probe.ok and not probe.slow and not probe.loading and tr.status == "up":
                # One lost probe is not a dead node: ask again at once before counting a failure,
                # so 10% probe loss makes no flaps (a dead node fails both at once).
                probe = await probe_fn(self.http, endpoint, hc.probe_timeout_s, tr.polls)
            # Also when not validating: the node probe reports loading models and free memory.
            await self._node_probe(node, rt, tr.polls, probe)
        now = self.clock()
        was = tr.status
        restarts = tr.restarts
        status = tr.observe(probe, now, hc)
        if tr.restarts != restarts or (was == "down" and status == "up"):
            self.speeds.reset(node.id)  # a restarted engine may run another model or build
            rt.loras = None  # and other --lora files
        if node.backend == "llamacpp" and probe.ok:
            rt.model_loras = probe.model_loras
        if node.backend == "llamacpp" and status == "up" and probe.ok and not probe.sleeping and rt.loras is None \
                and rt.model_loras is None:  # router mode's adapters are per model, in its listing
            rt.loras = await llamacpp.read_loras(self.http, endpoint, hc.probe_timeout_s)
        sp = tr.speed
        if sp.window_prefill is not None or sp.window_decode is not None:
            self.speeds.counters(node.id, self._served(node, probe), now, prefill_tps=sp.window_prefill,
                                 prefill_c=max(probe.running, 1), decode_tps=sp.window_decode,
                                 decode_c=sp.window_batch)
        check = self._hardware(node, rt)
        state = self._state(node, tr, rt, probe, status, check, now)
        if status == "up" and rt.failed_at and state.models and (rt.calibration is None or rt.calibration.done()):
            if now - rt.failed_at > self.cfg.router.cooldown_s:
                rt.failed_at = 0.0  # cooled down already
            else:
                base = [m for m in state.models if m not in self.cfg.adapters] or state.models
                rt.calibration = asyncio.create_task(self._recover(node, rt, base[0]),
                                                     name=f"recover-{node.id}")
        if status == "up" and hc.calibrate and state.models:
            self._maybe_calibrate(node, rt, state, now)
        metrics.polled(node.id, probe.ok, probe.loading, probe.slow, time.perf_counter() - t0, state)
        gen = link_of(self.nc).generation if self.nc is not None else 0
        if gen != self._link_gen:  # reconnected: the broker may have lost the bucket, write all
            self._link_gen = gen
            self.writes.forget_all()
        if node.id in self._tasks and self.writes.due(state, now, hc.poll_interval_s * (1 + hc.jitter)):
            await self.kv.put(node.id, _encode(state))  # not removed while we probed
            self.writes.wrote(state, now)
        # Listed once written: `zml nodes` shows no state the routers could not have yet.
        if node.id in self._tasks:
            self.states[node.id] = state
        return state

    async def _node_probe(self, node: NodeConfig, rt: _NodeRuntime, poll: int, probe: Probe) -> None:
        assert self.http is not None
        if rt.has_probe is False and poll - rt.probe_checked_at < NO_PROBE_RECHECK:
            return
        separate = node.probe_endpoint is not None
        if not separate and not probe.ok and not probe.loading:
            return  # the engine (and so its built-in probe) is unreachable: nothing to learn
        base = node.probe_endpoint or node.endpoint
        try:
            doc = await nodeprobe.fetch(self.http, base, self.cfg.health.probe_timeout_s, separate=separate)
        except nodeprobe.Unreachable:
            return
        rt.probe_checked_at = poll
        rt.has_probe = doc is not None
        rt.doc = doc

    def _hardware(self, node: NodeConfig, rt: _NodeRuntime) -> HardwareCheck | None:
        """None until the node has been reached once (nothing to judge yet)."""
        hc = self.cfg.health
        if not hc.validate_hardware or rt.has_probe is None:
            return None
        base = (node.probe_endpoint or node.endpoint).rstrip("/")
        return validate_hardware(node.accelerator, rt.doc, strict=hc.require_node_probe,
                                 probe_url=base + nodeprobe.PATH)

    @staticmethod
    def _profile(node: NodeConfig) -> SimProfile:
        """What the node is told to be: its type's profile, or what its [nodes.sim] says
        (never a sim's hidden true speeds: those are for learning)."""
        sim = node.sim
        prof = SimProfile.for_type(
            node.accelerator,
            speed=sim.speed if sim else None,
            prefill_tps=sim.prefill_tps if sim else None,
            decode_tps=sim.decode_tps if sim else None,
            max_concurrency=sim.max_concurrency if sim else None,
        )
        scale = sim.time_scale if sim else 1.0
        if scale != 1.0:
            prof = replace(prof, prefill_tps=prof.prefill_tps * scale, decode_tps=prof.decode_tps * scale)
        return prof

    def _served(self, node: NodeConfig, probe: Probe) -> list[str]:
        prev = self.states.get(node.id)
        return list(prev.models) if prev is not None and prev.models else list(node.models)

    def _maybe_calibrate(self, node: NodeConfig, rt: _NodeRuntime, state: NodeState, now: float) -> None:
        hc = self.cfg.health
        if rt.calibration is not None and not rt.calibration.done():
            return
        if state.queue_running >= max(state.max_concurrency, 1):
            return  # a full node measures its queue, not its speed; the routers' samples will do
        # an adapter runs at its base model's speed: the base is what is measured
        due = self.speeds.needs_calibration(node.id, [m for m in state.models if m not in self.cfg.adapters], now,
                                            hc.calibrate_every_s, busy=state.queue_running + state.queue_waiting > 0)
        if due is None:
            return
        model, confirm = due
        self.speeds.calibrating(node.id, model, now, confirm)
        rt.calibration = asyncio.create_task(self._calibrate(node, model, confirm), name=f"calibrate-{node.id}")

    async def _calibrate(self, node: NodeConfig, model: str, confirm: bool = False) -> None:
        assert self.http is not None
        hc = self.cfg.health
        served = node.served_names.get(model, model)
        got = await calibrate(self.http, node.endpoint, served, prompt_tokens=hc.calibrate_prompt_tokens,
                              max_tokens=hc.calibrate_max_tokens, timeout=max(30.0, 10 * hc.probe_timeout_s),
                              api_key=node.api_key, lora_off=self._holds_loras(node))
        metrics.calibrated(node.id, got is not None)
        if got is None or node.id not in self._tasks:
            return
        if self.speeds.calibration(node.id, model, self.clock(), prefill_tps=got.prefill_tps,
                                   decode_tps=got.decode_tps, engine=got.engine, confirm=confirm):
            self._moved(node.id)
        log.info("%s %s for %s: prefill %.0f tok/s, decode %.1f tok/s (ttft %.3f s, %d prompt tokens%s)",
                 "confirmed" if confirm else "calibrated", node.id, model, got.prefill_tps, got.decode_tps,
                 got.ttft_s, got.prompt_tokens, ", engine timings" if got.engine else "")

    def _moved(self, node_id: str) -> None:
        if (rt := self.runtime.get(node_id)) is not None:
            rt.moved.set()

    def _holds_loras(self, node: NodeConfig) -> bool:
        rt = self.runtime.get(node.id)
        return node.backend == "llamacpp" and rt is not None and bool(rt.loras or any((rt.model_loras or {}).values()))

    async def _recover(self, node: NodeConfig, rt: _NodeRuntime, model: str) -> None:
        """A node routers saw fail answers its probes again: one short real request, and if it
        is answered, their cooldown is lifted (NodeMark ``recovered``) instead of the node idling
        out [router] cooldown_s while its peers queue (docs/health.md)."""
        assert self.http is not None and self.nc is not None
        failed_at = rt.failed_at
        got = await calibrate(self.http, node.endpoint, node.served_names.get(model, model), prompt_tokens=32,
                              max_tokens=8, timeout=max(5.0, 2 * self.cfg.health.probe_timeout_s),
                              api_key=node.api_key, lora_off=self._holds_loras(node))
        if got is None or node.id not in self._tasks or rt.failed_at != failed_at:
            return  # still failing, removed, or failed again meanwhile: the next poll tries again
        rt.failed_at = 0.0
        mark = NodeMark(router_id="health", node_id=node.id, kind="cooldown", for_s=0.0, reason=RECOVERED,
                        ts=self.clock())
        await self.nc.publish(subjects.NODE_MARKS, _encode(mark))
        metrics.recovered(node.id)
        log.info("node %s answers again (a %d-token request in %.2f s): routers' cooldown lifted", node.id,
                 got.prompt_tokens, got.ttft_s)

    def _state(self, node: NodeConfig, tr: Tracker, rt: _NodeRuntime, probe: Probe, status: str,
               check: HardwareCheck | None, now: float) -> NodeState:
        prof = self._profile(node)
        capacity = probe.max_concurrency or prof.max_concurrency
        prev = self.states.get(node.id)
        doc = rt.doc or {}
        # Keep the last known models/queue while a node is failing, so `zml nodes` shows them.
        # The engine reports its own names; the fleet speaks ZML's, and an engine's name that is
        # no model of the fleet's stays the engine's (zml_health.served).
        if probe.ok:
            split = split_models(probe.models, configured=node.models, served_names=node.served_names,
                                 known=self._known_models() | rt.warmed if rt.warmed else self._known_models())
            models, unknown = split.models, split.unknown
        else:
            models, unknown = (prev.models, prev.unknown_models) if prev else ([], [])
        sleeping = probe.sleeping if probe.ok else (prev.sleeping if prev else False)
        if sleeping and node.backend == "vllm":
            models = []  # a sleeping vLLM answers nothing until woken (warmup's /wake_up)
        running = probe.running if probe.ok else (prev.queue_running if prev else 0)
        waiting = probe.waiting if probe.ok else (prev.queue_waiting if prev else 0)
        loading = self._loading_models(node, rt, probe, status, models, now)
        for m, deadline in list(rt.draining.items()):
            if now > deadline:
                del rt.draining[m]
        draining = [m for m in models if m in rt.draining]
        # llama.cpp: the adapters of its --lora files, on the base models it serves now
        routable = [m for m in models if m not in loading and m not in rt.draining]
        lora_ids: dict[str, int] = {}
        lora_count = 0
        model_adapters: dict[str, list[str]] = {}
        if node.backend == "llamacpp" and rt.model_loras is not None:
            # router mode: each model's instance has its own --lora files (ids per model), listed
            # loaded or not
            for m in dict.fromkeys([*node.models, *models]):
                files = rt.model_loras.get(node.served_names.get(m, m), [])
                ids = match_loras(enumerate(files), self.cfg.adapters, [m])
                if ids:
                    model_adapters[m] = sorted(ids)
                if m in routable:
                    lora_count += len(files)
                    lora_ids.update(ids)
        elif node.backend == "llamacpp":
            lora_ids = match_loras([(a.id, a.path) for a in rt.loras or ()], self.cfg.adapters, routable)
            lora_count = len(rt.loras or ())
        routable += [a for a in lora_ids if a not in routable]
        asleep = sleeping and node.backend == "vllm"  # its models come back when warmup wakes it
        missing = [] if asleep else [m for m in node.models if m not in models and m not in loading]
        source = self.sources.get(node.id, "config")
        notes = [mismatch_note(node.id, missing, unknown, source=source),
                 tr.slow_note(now, self.cfg.health.error_window_s), check.note if check is not None else ""]
        reason = tr.reason
        if check is not None and not check.ok:
            status, reason = "invalid", check.reason
        error_rate = tr.error_rate(now, self.cfg.health.error_window_s)
        measured = tr.speed.prefill_tps is not None and tr.speed.decode_tps is not None
        speeds = self.speeds.publish(node.id, models, now)
        est = speeds.main
        free = doc.get("free_memory_gib")
        total = doc.get("memory_gib")
        count = doc.get("device_count")
        return NodeState(
            node_id=node.id,
            accelerator_type=node.accelerator,
            family=node.effective_family,
            endpoint=node.endpoint,
            backend=node.backend,
            status=status,  # type: ignore[arg-type]
            reason=reason if status != "up" else "",
            models=routable,
            draining_models=draining,
            adapters=[m for m in routable if m in self.cfg.adapters],
            lora_ids=lora_ids,
            model_adapters=model_adapters,
            lora_count=lora_count,
            adapter_slots=node.adapter_slots,
            adapters_on_request=node.adapters_on_request,
            adapter_load_s=round(rt.adapter_load_s, 3),
            served_names=engine_names(node, routable, self.cfg.adapters),
            missing_models=missing,
            unknown_models=unknown,
            loading_models=loading,
            sleeping=sleeping,
            queue_running=running,
            queue_waiting=waiting,
            max_concurrency=capacity,
            kv_cache_usage=probe.kv_cache_usage if probe.ok else (prev.kv_cache_usage if prev else 0.0),
            free_memory_gib=float(free) if isinstance(free, (int, float)) else None,
            error_rate=round(error_rate, 4),
            tokens_per_s=round(tr.tokens_per_s, 3),
            # The learned estimate (zml_health.speedbook): the prior is the type's profile.
            prefill_tps=est.prefill_tps,
            decode_tps=est.decode_tps,
            speeds_measured=measured,
            speeds_source=est.source,
            speeds_at=est.at,
            speeds_confidence=est.confidence,
            prefill_sigma=est.prefill_sigma,
            decode_sigma=est.decode_sigma,
            decode_slowdown=est.decode_slowdown,
            model_speeds=speeds.models,
            health_score=tr.slowed(health_score(error_rate, running, waiting, capacity), now,
                                   self.cfg.health.error_window_s) if status == "up" else 0.0,
            cost_per_hour=node.effective_cost,
            last_ok=tr.last_ok,
            updated_at=now,
            last_inference_at=tr.last_inference_at,
            requests_per_s=round(tr.requests_per_s, 4),
            tokens_per_s_history=list(tr.history),
            ttft_s=tr.ttft_s,
            consecutive_failures=tr.fails,
            driver_version=str(doc.get("driver_version") or ""),
            device_count=count if isinstance(count, int) else 0,
            memory_gib=float(total) if isinstance(total, (int, float)) else None,
            note="; ".join(n for n in notes if n),
            source=source,
            poll_interval_s=self.cfg.health.poll_interval_s,
            kv_block_size=(probe.kv_block_size if probe.ok and probe.kv_block_size else
                           prev.kv_block_size if prev else 0) or 0,
            kv_blocks=(probe.kv_cache_blocks if probe.ok and probe.kv_cache_blocks else
                       prev.kv_blocks if prev else 0) or 0,
            prefix_cache_hit_rate=round(tr.prefix_hit_rate, 4) if tr.prefix_hit_rate is not None else None,
            prefix_cache_queries=tr.last_prefix[0] if tr.last_prefix else 0.0,
            prefix_cache_hits=tr.last_prefix[1] if tr.last_prefix else 0.0,
            cache_fidelity=self._fidelity(node),
            kv_events=self.bridges.status(node.id),
            roles=[] if set(node.roles) == {"prefill", "decode"} else list(node.roles),
            kv_group=node.kv_group or "",
            kv_gbps=node.kv_gbps or 0.0,
            kv_bootstrap_port=node.kv_bootstrap_port or 0,
        )

    def _known_models(self) -> frozenset[str]:
        """The fleet's models: zml.toml's and every registered node's (made again when the
        registered nodes change, not on every poll: a poll of each of 1,000 nodes would
        otherwise walk all 1,000)."""
        if self._known is None or self._known[0] != self._registry_gen:
            known = self.cfg.model_names()
            for n in self.nodes.values():
                known.update(n.models)
            self._known = (self._registry_gen, frozenset(known))
        return self._known[1]

    def _fidelity(self, node: NodeConfig) -> str:
        if node.kv_events is not None and self.bridges.status(node.id) in ("live", "replaying"):
            return "precise"
        return "approximate" if node.backend == "tgi" else "reported"

    def _loading_models(self, node: NodeConfig, rt: _NodeRuntime, probe: Probe, status: str,
                        models: list[str], now: float) -> list[str]:
        loading: dict[str, None] = {}
        doc_loading = (rt.doc or {}).get("loading_models") if probe.ok or probe.loading else None
        back = {served: name for name, served in node.served_names.items()}
        for m in [*(doc_loading or []), *(back.get(m, m) for m in probe.loading_models)]:
            if isinstance(m, str):
                loading[m] = None
        for m, deadline in list(rt.pending_loads.items()):
            if (m in models and m not in loading) or now > deadline:
                del rt.pending_loads[m]
            else:
                loading[m] = None
        if status == "loading":
            for m in node.models:
                if m not in models:
                    loading[m] = None
        return list(loading)

    # --- events ----------------------------------------------------------------------------
    def _on_completed(self, msg: Msg) -> None:
        try:
            ev = completion_counts_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        ts = ev.ts or self.clock()
        tr = self.trackers.get(ev.node_id)
        if tr is not None:
            tr.record_request(ts, ev.ok, ev.node_error)
            if ev.speed is not None:
                if ev.speed.adapter_load_s is not None and (rt := self.runtime.get(ev.node_id)) is not None:
                    # the engine loaded the request's adapter for it: the load time routers cost
                    rt.adapter_load_s = fold_adapter_load_s(rt.adapter_load_s, ev.speed.adapter_load_s)
                st = self.states.get(ev.node_id)
                if self.speeds.sample(ev.node_id, ev.model, ev.speed, ts, st.max_concurrency if st else 0):
                    self._moved(ev.node_id)
        for node_id in ev.failed_nodes:
            if node_id != ev.node_id and (other := self.trackers.get(node_id)) is not None:
                other.record_request(ts, False, True)
        for node_id in ev.slow_nodes:
            if (slow := self.trackers.get(node_id)) is not None:
                slow.last_slow_at = max(slow.last_slow_at, ts)
        # nodes the routers now cool down: probed back into service when they answer again
        for node_id in (*ev.failed_nodes, *ev.slow_nodes, *((ev.node_id,) if ev.node_error else ())):
            if (rt := self.runtime.get(node_id)) is not None:
                rt.failed_at = max(rt.failed_at, ts)

    async def _on_warmup(self, msg: Msg) -> None:
        try:
            ev = warmup_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        rt = self.runtime.get(ev.node_id)
        if rt is None:
            return
        if ev.model in self.cfg.adapters:  # an adapter's load: its time is what routers' estimates cost
            if ev.phase == "loaded" and ev.elapsed_s is not None:
                rt.adapter_load_s = fold_adapter_load_s(rt.adapter_load_s, ev.elapsed_s)
            return
        if ev.phase == "started":
            rt.pending_loads[ev.model] = self.clock() + self.cfg.warmup.load_timeout_s
            rt.warmed.add(ev.model)
        elif ev.phase in ("loaded", "failed"):
            rt.pending_loads.pop(ev.model, None)
        if ev.phase == "draining":
            # the unload follows within the planner's drain timeout; a lost "unloaded" expires
            rt.draining[ev.model] = self.clock() + self.cfg.planner.drain_timeout_s + 60.0
        elif ev.phase in ("unloaded", "started", "loaded"):
            rt.draining.pop(ev.model, None)

    # --- admin -----------------------------------------------------------------------------
    async def _on_list(self, msg: Msg) -> None:
        now = self.clock()
        nodes = [msgspec.structs.replace(self.states[n], age_s=round(max(0.0, now - self.states[n].updated_at), 3))
                 for n in sorted(self.states)]
        # Registered nodes not polled yet still show up, so an add is visible at once.
        for node_id in sorted(set(self.nodes) - set(self.states)):
            node = self.nodes[node_id]
            nodes.append(NodeState(node_id=node.id, accelerator_type=node.accelerator,
                                   family=node.effective_family, endpoint=node.endpoint,
                                   backend=node.backend, status="unknown",
                                   source=self.sources.get(node_id, "config")))
        await msg.respond(_encode({"nodes": nodes}))

    async def _reply_error(self, msg: Msg, exc: ZMLError) -> None:
        assert self.nc is not None
        if msg.reply:  # Msg.respond takes no headers
            await self.nc.publish(msg.reply, _encode(exc.to_body()), headers={subjects.H_ERROR_CODE: exc.code})

    async def _on_add(self, msg: Msg) -> None:
        try:
            try:
                req = node_add_decoder.decode(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise BadRequestError(f"invalid node registration: {with_choices(NodeSpec, str(exc))}") from exc
            try:
                node = spec_to_config(req.node)
            except ConfigError as exc:
                raise BadRequestError(exc.message) from exc
            async with self._admin_lock:
                exists = node.id in self.nodes
                if exists and not req.replace:
                    raise BadRequestError(f"node {node.id!r} is already registered "
                                          "(remove it first, or add with replace)")
                assert self.registry is not None
                await self.registry.put(node.id, _encode(RegistryEntry(node=req.node, at=self.clock())))
                if exists:
                    await self._stop_polling(node.id)
                self.nodes[node.id] = node
                self._registry_gen += 1
                self.sources[node.id] = "registry"
                self._start_polling(node, self.clock())
            log.info("node %s registered (%s at %s)", node.id, node.accelerator, node.endpoint)
            await msg.respond(_encode(NodeAdded(node=req.node, replaced=exists)))
        except ZMLError as exc:
            await self._reply_error(msg, exc)

    async def _on_remove(self, msg: Msg) -> None:
        try:
            try:
                req = node_remove_decoder.decode(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise BadRequestError(f"invalid node removal: {exc}") from exc
            async with self._admin_lock:
                if req.node_id not in self.nodes:
                    raise BadRequestError(f"no node {req.node_id!r} is registered")
                assert self.registry is not None and self.kv is not None
                if req.node_id in self.config_nodes:  # zml.toml would bring it back: tombstone
                    await self.registry.put(req.node_id, _encode(RegistryEntry(removed=True, at=self.clock())))
                else:
                    await self.registry.delete(req.node_id)
                await self._stop_polling(req.node_id)
                self.nodes.pop(req.node_id, None)
                self._registry_gen += 1
                self.sources.pop(req.node_id, None)
                await self.kv.delete(req.node_id)
            log.info("node %s removed", req.node_id)
            await msg.respond(_encode(NodeRemoved(node_id=req.node_id)))
        except ZMLError as exc:
            await self._reply_error(msg, exc)
