"""The warmup service: watches node state and request rate, pre-loads warm models in quiet
windows (slow cold-start families first, at most K nodes at a time), keeps idle models warm,
and answers ``zml serve`` (``zml.warmup.serve``).

Inputs: KV ``zml_nodes`` (NodeState, from health), KV ``zml_registry`` (run-time nodes and the
models they should serve), ``zml.events.completed`` (routers). Outputs: load calls to nodes,
``zml.events.warmup`` (health marks the model "loading" on that node until it is loaded).
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from zmlcore import subjects
from zmlcore.fleet.accelerators import ACCELERATORS, canonical_family
from zmlcore.config import ZMLConfig
from zmlcore.fleet.catalog import does_not_exist, known_models
from zmlcore.errors import BadRequestError, ModelNotLoadedError, ZMLError
from zmlcore.messages import NodeState, ServeReply, ServeTarget, WarmupEvent, node_state_decoder
from zmlcore.messages.admin import registry_entry_decoder
from zmlcore.messages.placement import PlacementEvent, PlanReply, plan_request_decoder
from zmlcore.messages.warmup import completed_decoder, serve_request_decoder
from zmlcore.placement import Placement
from zmlcore.placement.forecast import RateHistory
from zmlcore.placement.moves import NodeNow, Step, blocked as moves_blocked, next_steps
from zmlcore.bus.direct import subscribe_direct
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.runtime.runner import cancel_and_wait
from zml_warmup import loader, metrics, placer
from zml_warmup.demand import DemandWindow
from zml_warmup.planner import Load, Want, keep_warm_due, plan_loads
from zml_warmup.rate import QuietDetector, RateTracker, in_fixed_window, metrics_rate

log = logging.getLogger("zml.warmup")

_encode = msgspec.json.encode
#: A failed load is not retried for this long.
FAILURE_BACKOFF_S = 60.0


class WarmupService:
    def __init__(self, cfg: ZMLConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.wc = cfg.warmup
        self.clock = clock
        now = clock()
        self.states: dict[str, NodeState] = {}
        self.config_wants: dict[str, Want] = {n.id: Want(n.id, n.accelerator, n.effective_family, tuple(n.models))
                                              for n in cfg.nodes}
        self.registry_wants: dict[str, Want] = {}
        self.removed: set[str] = set()
        self.endpoints: dict[str, tuple[str, str, str | None]] = {
            n.id: (n.endpoint, n.backend, n.api_key) for n in cfg.nodes}
        #: node -> ZML model name -> the engine's name for it (requests carry the latter).
        self.served_names: dict[str, dict[str, str]] = {n.id: dict(n.served_names) for n in cfg.nodes}
        self.rates = RateTracker(self.wc.rate_window_s, now)
        self.quiet = QuietDetector(self.wc, now)
        self.warm_models = [m for m, mc in cfg.models.items() if mc.warm]
        self.keep_warm = {m: mc.keep_warm_after_s for m, mc in cfg.models.items() if mc.keep_warm_after_s}
        #: (node, model) -> (started at, reason, mechanism): loads we asked for, not yet seen loaded.
        self.in_progress: dict[tuple[str, str], tuple[float, str, str]] = {}
        self.failed: dict[tuple[str, str], float] = {}
        self.last_used: dict[tuple[str, str], float] = {}
        self.events: list[WarmupEvent] = []  # recent, for tests and `zml warmup --status`
        # --- placement planner ([planner], docs/placement.md) ---
        self.demand = DemandWindow(cfg.planner.window_s, now)
        #: the rates measured at each plan: the demand looked ahead on ([planner] forecast_*)
        self.rate_history = RateHistory(cfg.planner.trend_s)
        self.started_at = now
        self.target: Placement | None = None
        self.plan_inputs: placer.Inputs | None = None
        self.planned_at = 0.0
        #: (kind, node, name) -> the task running that move (unloads and adapter moves; loads
        #: are in ``in_progress`` like any other load).
        self.moving: dict[tuple[str, str, str], asyncio.Task[None]] = {}
        #: adapters loaded or unloaded by us, until the node's state says so itself
        self.adapter_moves: dict[tuple[str, str], bool] = {}
        #: (node, adapter) -> when this service's load of it there succeeded
        self.adapter_loaded_at: dict[tuple[str, str], float] = {}
        self.last_steps: tuple[list[Step], list[Step], bool] | None = None
        self.placement_events: list[PlacementEvent] = []
        self.nc: NATS | None = None
        self.http: httpx.AsyncClient | None = None
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._work: set[asyncio.Task[None]] = set()

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self, nc: NATS) -> None:
        self.nc = nc
        self.http = httpx.AsyncClient()
        # Followers re-create their watch (and re-read the snapshot) after every reconnect.
        nodes = KVFollower(nc, subjects.NODES_BUCKET, on_put=self._put_node, on_delete=self._delete_node)
        registry = KVFollower(nc, subjects.REGISTRY_BUCKET, on_put=self._put_registry,
                              on_delete=self._delete_registry)
        self._tasks.append(asyncio.create_task(nodes.run()))
        self._tasks.append(asyncio.create_task(registry.run()))
        await nodes.wait_ready(2.0)
        # One event per request of every router: taken in nats-py's reader, no task switch each
        # (zmlcore.bus.direct; the handler only updates counters).
        self._subs.append(await subscribe_direct(nc, subjects.event(subjects.EVENT_COMPLETED), self._on_completed))
        self._subs.append(await nc.subscribe(subjects.WARMUP_SERVE, cb=self._on_serve))
        self._subs.append(await nc.subscribe(subjects.WARMUP_PLAN, cb=self._on_plan))
        self._tasks.append(asyncio.create_task(self._sweep_forever()))
        if self.cfg.planner.mode != "off":
            self._tasks.append(asyncio.create_task(self._plan_forever()))

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already closing
                pass
        await cancel_and_wait([*self._tasks, *self._work])
        if self.http:
            await self.http.aclose()

    def _put_node(self, key: str, value: bytes) -> None:
        try:
            st = node_state_decoder.decode(value)
        except msgspec.DecodeError:
            return
        self.states[key] = st
        self._check_progress(st)

    def _delete_node(self, key: str) -> None:
        self.states.pop(key, None)

    def _delete_registry(self, key: str) -> None:
        self.registry_wants.pop(key, None)
        self.removed.discard(key)

    def _put_registry(self, key: str, value: bytes) -> None:
        try:
            reg = registry_entry_decoder.decode(value)
        except msgspec.DecodeError:
            return
        if reg.removed or reg.node is None:
            self.removed.add(key)
            self.registry_wants.pop(key, None)
        else:
            n = reg.node
            self.removed.discard(key)
            fam = n.family or (self.states[n.id].family if n.id in self.states else "")
            fam = fam or (ACCELERATORS[n.accelerator].family if n.accelerator in ACCELERATORS else "")
            self.registry_wants[n.id] = Want(n.id, n.accelerator, fam, tuple(n.models))
            self.endpoints[n.id] = (n.endpoint, n.backend, None)
            self.served_names[n.id] = dict(n.served_names)

    def wants(self) -> list[Want]:
        merged = {**self.config_wants, **self.registry_wants}
        return [w for k, w in merged.items() if k not in self.removed]

    # --- inputs ----------------------------------------------------------------------------
    def _on_completed(self, msg: Msg) -> None:
        try:
            ev = completed_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        ts = ev.ts or self.clock()
        model = self.cfg.resolve_model(ev.model)
        self.rates.record(model, ts)
        # adapters are planned by their own name (the router reports the name asked for)
        self.demand.record(ev.model if ev.model in self.cfg.adapters else model, ts, ev.prompt_tokens,
                           ev.completion_tokens)
        if (not ev.ok and ev.error_code == "MODEL_NOT_LOADED" and ev.model in self.cfg.adapters
                and self.cfg.planner.mode == "apply"):
            self.adapter_on_demand(ev.model)
        if ev.node_id:
            self.last_used[(ev.node_id, model)] = max(ts, self.last_used.get((ev.node_id, model), 0.0))

    def _check_progress(self, st: NodeState) -> None:
        now = self.clock()
        for (node_id, model), (started, reason, mech) in list(self.in_progress.items()):
            if node_id != st.node_id:
                continue
            if model in st.models and model not in st.loading_models:
                del self.in_progress[(node_id, model)]
                self._emit(WarmupEvent(node_id=node_id, model=model, phase="loaded", reason=reason, mechanism=mech,
                                       ts=now, elapsed_s=round(now - started, 3)))
                log.info("%s loaded %s in %.1f s (%s)", node_id, model, now - started, reason)

    # --- the sweep -------------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            try:
                self.sweep()
            except Exception:
                log.exception("warmup sweep failed")
            await asyncio.sleep(self.wc.sweep_interval_s)

    def quiet_models(self, now: float) -> dict[str, bool]:
        out = {}
        for model in {*self.warm_models, *self.keep_warm}:
            rate = self.rates.rate(model, now)
            if self.wc.use_node_metrics:
                rate = max(rate, metrics_rate(model, self.states.values()))
            out[model] = self.quiet.update(model, rate, now)
        return out

    def sweep(self) -> list[Load]:
        """One decision round: expire stale loads, start new ones, keep idle models warm."""
        now = self.clock()
        for key, (began, reason, mech) in list(self.in_progress.items()):
            if now - began > self.wc.load_timeout_s:
                del self.in_progress[key]
                self.failed[key] = now
                self._emit(WarmupEvent(node_id=key[0], model=key[1], phase="failed", reason=reason, mechanism=mech,
                                       message=f"not loaded after {self.wc.load_timeout_s:g} s", ts=now))
        quiet = self.quiet_models(now)
        started: list[Load] = []
        if self.cfg.planner.mode == "apply":
            self.apply_plan(now)  # the plan owns placement: no warm-model loads beside it
        elif self.wc.enabled:
            blocked = [k for k, t in self.failed.items() if now - t < FAILURE_BACKOFF_S]
            started = plan_loads(wants=self.wants(), states=self.states, warm_models=self.warm_models, quiet=quiet,
                                 in_progress=self.in_progress, max_concurrent=self.wc.max_concurrent_loads,
                                 priority_families=self.wc.priority_families, blocked=blocked)
            reason = self.quiet.reason(now)
            for ld in started:
                self._begin(ld, reason, now)
        if self.keep_warm:
            quiet_keep = {k: v for k, v in self.keep_warm.items() if quiet.get(k, False)}
            for ld in keep_warm_due(states=self.states, keep_warm=quiet_keep, last_used=self.last_used, now=now):
                self.last_used[(ld.node_id, ld.model)] = now
                self._spawn(self._probe(ld))
        return started

    def _begin(self, ld: Load, reason: str, now: float) -> None:
        self.in_progress[(ld.node_id, ld.model)] = (now, reason, "")
        self._spawn(self._load(ld, reason))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._work.add(task)
        task.add_done_callback(self._work.discard)

    async def _load(self, ld: Load, reason: str) -> loader.LoadResult:
        assert self.http is not None
        key = (ld.node_id, ld.model)
        started = self.in_progress.get(key, (self.clock(), reason, ""))[0]
        endpoint, backend, api_key = self.endpoints.get(ld.node_id, ("", "openai", None))
        if not endpoint and ld.node_id in self.states:
            known = self.states[ld.node_id]
            endpoint, backend = known.endpoint, known.backend
        self._emit(WarmupEvent(node_id=ld.node_id, model=ld.model, phase="started", reason=reason, ts=self.clock()))
        res = await loader.load(self.http, endpoint, backend, ld.model, served=self._served(ld),
                                timeout=min(self.wc.load_timeout_s, 600.0), api_key=api_key,
                                lora_off=self._holds_loras(ld.node_id))
        now = self.clock()
        if not res.ok:
            self.in_progress.pop(key, None)
            self.failed[key] = now
            self._emit(WarmupEvent(node_id=ld.node_id, model=ld.model, phase="failed", reason=reason,
                                   mechanism=res.mechanism, message=res.message, ts=now))
            log.warning("%s could not load %s: %s", ld.node_id, ld.model, res.message)
            return res
        if key in self.in_progress:
            self.in_progress[key] = (started, reason, res.mechanism)
        log.info("%s loading %s (%s, %s)", ld.node_id, ld.model, res.mechanism, reason)
        st = self.states.get(ld.node_id)
        if st is not None:
            self._check_progress(st)
        return res

    def _holds_loras(self, node_id: str) -> bool:
        """A llama-server holding --lora adapters (zml_router.node.lora: ask it with them off)."""
        st = self.states.get(node_id)
        return st is not None and st.lora_count > 0

    def _served(self, ld: Load) -> str | None:
        """The engine's name for the model: the node's served_names (registry/zml.toml, else
        what health last published)."""
        names = self.served_names.get(ld.node_id)
        if names is None and ld.node_id in self.states:
            names = self.states[ld.node_id].served_names
        return (names or {}).get(ld.model)

    async def _probe(self, ld: Load) -> None:
        assert self.http is not None
        endpoint, _, api_key = self.endpoints.get(ld.node_id, ("", "", None))
        endpoint = endpoint or (self.states[ld.node_id].endpoint if ld.node_id in self.states else "")
        if not endpoint:
            return
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            res = await loader.warmup_request(self.http, endpoint.rstrip("/"), self._served(ld) or ld.model,
                                              timeout=30.0, headers=headers, lora_off=self._holds_loras(ld.node_id))
        except httpx.HTTPError as exc:
            res = loader.LoadResult(False, "warmup_request", str(exc))
        self._emit(WarmupEvent(node_id=ld.node_id, model=ld.model, phase="probed" if res.ok else "failed",
                               reason="keep_warm", mechanism="warmup_request", message=res.message, ts=self.clock()))

    def _emit(self, ev: WarmupEvent) -> None:
        metrics.event(ev)
        self.events.append(ev)
        del self.events[:-200]
        if self.nc is not None and self.nc.is_connected:
            self._spawn(self.nc.publish(subjects.event(subjects.EVENT_WARMUP), _encode(ev)))

    # --- placement planner -----------------------------------------------------------------
    async def _plan_forever(self) -> None:
        while True:
            try:
                await self.replan()
            except Exception:
                log.exception("placement plan failed")
            await asyncio.sleep(self.cfg.planner.interval_s)

    def wants_by_node(self) -> dict[str, tuple[str, ...]]:
        return {w.node_id: w.models for w in self.wants()}

    async def replan(self) -> Placement:
        """Plan from the demand and node states seen so far (the solver in a thread: ~0.2 s
        at 1,000 nodes would otherwise hold the event loop)."""
        now = self.clock()
        inputs = placer.gather(self.cfg, self.states, self.wants_by_node(), self.demand, now, self.rate_history)
        target = await asyncio.to_thread(placer.make_plan, self.cfg, inputs)
        self.plan_inputs, self.target, self.planned_at = inputs, target, now
        rep = placer.reply(self.cfg, inputs, target, self.states, now)
        metrics.plan(rep)
        self._emit_placement(PlacementEvent(phase="planned", ts=now, cost_now_per_h=rep.cost_now_per_h,
                                            cost_plan_per_h=rep.cost_plan_per_h, moves=len(rep.moves)))
        log.info("placement plan: $%.2f/h now, $%.2f/h planned, %d move(s)", rep.cost_now_per_h,
                 rep.cost_plan_per_h, len(rep.moves))
        return target

    def _held_now(self) -> dict[str, NodeNow]:
        held = placer.holding(self.states, self.cfg)
        for (node, adapter), loaded in self.adapter_moves.items():
            if node in held:
                h = held[node]
                ads = h.adapters | {adapter} if loaded else h.adapters - {adapter}
                held[node] = NodeNow(h.models, h.loading, ads, h.up, h.slots, h.adapter_slots, h.adapters_fixed)
        return held

    def apply_plan(self, now: float) -> list[Step]:
        """Start the plan's steps that can run now (make before break: see zmlcore.placement.moves)."""
        if self.target is None or self.planned_at - self.started_at < self.cfg.planner.window_s:
            return []  # a plan on less than a window of demand would unload what is merely unmeasured
        target = self.target
        held = {n: h for n, h in self._held_now().items() if n in target.models}
        loads = sum(1 for (_, _), (_, reason, _) in self.in_progress.items() if reason == "placement")
        pi = self.plan_inputs
        short = placer.short_models(pi) if pi is not None else set()
        run, wait = next_steps(held, target.models, target_adapters=target.adapters,
                               adapter_base={a: c.base for a, c in self.cfg.adapters.items()},
                               max_loads=self.wc.max_concurrent_loads, in_progress=loads, urgent=short,
                               capacity={o.node_id: o.capacity for o in pi.offers} if pi is not None else None,
                               demand=placer.demand_rates(pi.demands, pi.adapters) if pi is not None else None)
        # blocked: the steps wait on each other (judged before any waits for a quiet window)
        stuck = moves_blocked(held, target.models, wait, run, loads + len(self.moving))
        if self.wc.quiet_windows and self.plan_inputs is not None and not in_fixed_window(self.wc.quiet_windows, now):
            # moves that only save money wait for a quiet window; a model short of capacity moves now
            run, later = placer.defer_outside_quiet(run, short)
            wait = [*later, *wait]
        if stuck and not (self.last_steps and self.last_steps[2]):
            self._emit_placement(PlacementEvent(phase="blocked", ts=now, message="; ".join(str(s) for s in wait)))
        self.last_steps = (run, wait, stuck)
        started: list[Step] = []
        for step in run:
            key = (step.kind, step.node_id, step.name)
            if key in self.moving or (step.kind == "load" and (step.node_id, step.name) in self.in_progress):
                continue
            if step.kind == "load":
                if (step.node_id, step.name) in self.failed and now - self.failed[(step.node_id, step.name)] < FAILURE_BACKOFF_S:
                    continue
                self._begin(Load(step.node_id, step.name), "placement", now)
            else:
                task = asyncio.ensure_future(self._move(step))
                self.moving[key] = task
                task.add_done_callback(partial(self._moved, key))
            self._emit_placement(PlacementEvent(phase="move_started", ts=now, node_id=step.node_id, name=step.name,
                                                kind=step.kind))
            started.append(step)
        return started

    def adapter_on_demand(self, adapter: str) -> str | None:
        """A request found the adapter on no node: load it now where its base runs (the plan
        keeps it there: the next plan counts that request's demand)."""
        if any(k[0] == "load_adapter" and k[2] == adapter for k in self.moving):
            return None  # already on its way
        if self._adapter_loaded(adapter):
            return None  # loaded: the request met a router (or health) that has not seen it yet
        node = placer.adapter_home(self.cfg, self.states, adapter)
        if node is None:
            return None
        step = Step("load_adapter", node, adapter)
        key = (step.kind, step.node_id, step.name)
        task = asyncio.ensure_future(self._move(step))
        self.moving[key] = task
        task.add_done_callback(partial(self._moved, key))
        if self.target is not None:
            self.target.adapters[node] = self.target.adapters.get(node, frozenset()) | {adapter}
        self._emit_placement(PlacementEvent(phase="move_started", ts=self.clock(), node_id=node, name=adapter,
                                            kind=step.kind, message="on demand: a request found it nowhere"))
        return node

    def _adapter_loaded(self, adapter: str) -> bool:
        """Some node up holds ``adapter``: health says so, or this service loaded it there after
        health's last look (a second copy on demand would be a refused request's lag, not need)."""
        for node, st in self.states.items():
            if st.status != "up":
                continue
            if adapter in st.adapters or self.adapter_loaded_at.get((node, adapter), -1.0) >= st.updated_at:
                return True
        return False

    def _moved(self, key: tuple[str, str, str], _task: "asyncio.Task[None]") -> None:
        self.moving.pop(key, None)

    async def _move(self, step: Step) -> None:
        assert self.http is not None
        endpoint, backend, api_key = self._endpoint(step.node_id)
        if step.kind == "unload":
            res = await self._drain_and_unload(step.node_id, step.name, endpoint, backend, api_key)
        elif step.kind == "load_adapter":
            path = self.cfg.adapters[step.name].path if step.name in self.cfg.adapters else ""
            began = self.clock()
            res = await loader.load_adapter(self.http, endpoint, backend, step.name, path, api_key=api_key)
            if res.ok:
                self.adapter_moves[(step.node_id, step.name)] = True
                self.adapter_loaded_at[(step.node_id, step.name)] = self.clock()
            if res.fresh or not res.ok:  # a load made now: health learns the node's adapter load time
                self._emit(WarmupEvent(node_id=step.node_id, model=step.name, phase="loaded" if res.ok else "failed",
                                       reason="placement", mechanism=res.mechanism, message=res.message,
                                       ts=self.clock(), elapsed_s=round(self.clock() - began, 3)))
        else:
            res = await loader.unload_adapter(self.http, endpoint, backend, step.name, api_key=api_key)
            if res.ok:
                self.adapter_moves[(step.node_id, step.name)] = False
        now = self.clock()
        self._emit_placement(PlacementEvent(phase="move_done" if res.ok else "move_failed", ts=now,
                                            node_id=step.node_id, name=step.name, kind=step.kind,
                                            message=res.message))
        if not res.ok:
            log.warning("%s on %s failed: %s", step.kind, step.node_id, res.message)
            await asyncio.sleep(FAILURE_BACKOFF_S)  # the key stays in self.moving: not retried at once

    async def _drain_and_unload(self, node_id: str, model: str, endpoint: str, backend: str,
                                api_key: str | None) -> loader.LoadResult:
        """Routers stop sending ``model`` here (health drops it from the node's routable
        models on "draining"), the requests already sent finish, then the engine unloads it."""
        assert self.http is not None
        began = self.clock()
        self._emit(WarmupEvent(node_id=node_id, model=model, phase="draining", reason="placement", ts=began))
        deadline = began + self.cfg.planner.drain_timeout_s
        poll = max(0.05, self.cfg.health.poll_interval_s / 4)
        routed_off_at: float | None = None
        while self.clock() < deadline:
            st = self.states.get(node_id)
            if st is None:
                break
            if routed_off_at is None and model not in st.models:
                routed_off_at = st.updated_at
            # idle in a state polled after the routers' view changed: nothing of ours in flight
            if (routed_off_at is not None and st.updated_at > routed_off_at + self.cfg.health.poll_interval_s / 2
                    and st.queue_running + st.queue_waiting == 0):
                break
            await asyncio.sleep(poll)
        res = await loader.unload(self.http, endpoint, backend, model, served=self._served(Load(node_id, model)),
                                  api_key=api_key)
        self._emit(WarmupEvent(node_id=node_id, model=model, phase="unloaded" if res.ok else "failed",
                               reason="placement", mechanism=res.mechanism, message=res.message, ts=self.clock(),
                               elapsed_s=round(self.clock() - began, 3)))
        return res

    def _endpoint(self, node_id: str) -> tuple[str, str, str | None]:
        endpoint, backend, api_key = self.endpoints.get(node_id, ("", "openai", None))
        if not endpoint and node_id in self.states:
            endpoint, backend = self.states[node_id].endpoint, self.states[node_id].backend
        return endpoint, backend, api_key

    def plan_reply(self) -> PlanReply:
        if self.target is None or self.plan_inputs is None:
            return placer.reply(self.cfg, placer.Inputs([], [], [], {}), None, self.states, 0.0)
        run, wait, stuck = self.last_steps if self.last_steps and self.cfg.planner.mode == "apply" else (None, None, False)
        return placer.reply(self.cfg, self.plan_inputs, self.target, self.states, self.planned_at, run, wait, stuck)

    async def _on_plan(self, msg: Msg) -> None:
        try:
            try:
                req = plan_request_decoder.decode(msg.data or b"{}")
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise BadRequestError(f"invalid plan request: {exc}") from exc
            if req.fresh:
                await self.replan()
            await msg.respond(_encode(self.plan_reply()))
        except ZMLError as exc:
            await self._reply_error(msg, exc)

    def _emit_placement(self, ev: PlacementEvent) -> None:
        self.placement_events.append(ev)
        del self.placement_events[:-200]
        if self.nc is not None and self.nc.is_connected:
            self._spawn(self.nc.publish(subjects.event(subjects.EVENT_PLACEMENT), _encode(ev)))

    # --- zml serve -------------------------------------------------------------------------
    async def _on_serve(self, msg: Msg) -> None:
        try:
            try:
                req = serve_request_decoder.decode(msg.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise BadRequestError(f"invalid serve request: {exc}") from exc
            reply = await self.serve(req.model, req.nodes, req.family)
            await msg.respond(_encode(reply))
        except ZMLError as exc:
            await self._reply_error(msg, exc)

    async def _reply_error(self, msg: Msg, exc: ZMLError) -> None:
        assert self.nc is not None
        if msg.reply:  # Msg.respond takes no headers
            await self.nc.publish(msg.reply, _encode(exc.to_body()), headers={subjects.H_ERROR_CODE: exc.code})

    async def serve(self, model_name: str, nodes: list[str], families: list[str]) -> ServeReply:
        model = self.cfg.resolve_model(model_name)
        wants = {w.node_id: w for w in self.wants()}
        fams = {canonical_family(f).lower() for f in families}
        if nodes:
            unknown = [n for n in nodes if n not in wants and n not in self.states]
            if unknown:
                raise BadRequestError(f"unknown node(s): {', '.join(unknown)} (see `zml nodes`)")
            chosen = list(nodes)
        else:
            chosen = [n for n, w in sorted(wants.items()) if model in w.models]
        if fams:
            chosen = [n for n in chosen if self._family(n, wants).lower() in fams]
        if not chosen:
            known = known_models(self.cfg.model_names() | {m for w in wants.values() for m in w.models},
                                 self.states.values())
            if model not in known:  # as a request and GET /v1/models/{model} say it
                raise ModelNotLoadedError(f"{does_not_exist(model)}; to load it anyway, name nodes with --nodes")
            where = f" in famil{'ies' if len(fams) > 1 else 'y'} {', '.join(sorted(families))}" if fams else ""
            raise BadRequestError(f"no node{where} is configured to serve {model!r}: list it in the node's "
                                  "`models` in zml.toml (or `zml nodes add`), or name nodes with --nodes")
        now = self.clock()
        targets: list[ServeTarget] = []
        loads: list[tuple[Load, asyncio.Task[loader.LoadResult]]] = []
        for node_id in chosen:
            st = self.states.get(node_id)
            if st is not None and model in st.models and model not in st.loading_models:
                targets.append(ServeTarget(node_id=node_id, state="loaded"))
                continue
            if st is not None and st.status in ("down", "invalid"):
                targets.append(ServeTarget(node_id=node_id, state="skipped",
                                           message=f"node is {st.status}" + (f": {st.reason}" if st.reason else "")))
                continue
            key = (node_id, model)
            if key in self.in_progress:
                targets.append(ServeTarget(node_id=node_id, state="loading", message="already loading"))
                continue
            self.in_progress[key] = (now, "serve", "")
            self.failed.pop(key, None)
            ld = Load(node_id, model)
            loads.append((ld, asyncio.ensure_future(self._load(ld, "serve"))))
        for ld, task in loads:
            res = await task
            state = ("loaded" if res.done else "loading") if res.ok else "failed"
            targets.append(ServeTarget(node_id=ld.node_id, state=state, mechanism=res.mechanism, message=res.message))
        targets.sort(key=lambda t: t.node_id)
        return ServeReply(model=model, targets=targets)

    def _family(self, node_id: str, wants: dict[str, Want]) -> str:
        if node_id in self.states:
            return self.states[node_id].family
        return wants[node_id].family if node_id in wants else ""
