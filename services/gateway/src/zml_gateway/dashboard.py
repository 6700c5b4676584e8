"""GET /dashboard: the live fleet page (static HTML/JS/CSS shipped in zml_gateway/static, no
build step, no CDN) and GET /dashboard/state, the JSON it polls every second.

The state joins three sources: the gateway's node table (health's KV view, run-time prices and
every router replica's in-flight/cooldown/saturation: :class:`zml_gateway.nodetable.NodeTable`), the
routers' completion events (``zml.events.completed``: decisions per second by family and node,
TTFT and latency percentiles, errors by code, over a sliding window), the saturation queue's
depth per model of the running config (JetStream consumer info) and the Batch API's batches
and their progress (the store's records, read every few seconds, kept current by the runners'
``zml.batch.events``). Each node's row says where what it shows comes from and how old it is:
its speeds' source (measured, learned, default) and age, its state's age, why it is not up. One state is built at most every ``CACHE_S`` however many
pages poll. With keys on, /dashboard/state wants an operator key, one of zml.toml's
``[gateway] api_keys`` (the page asks for it and keeps it in the tab's sessionStorage); the
static files carry no data.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from zmlcore import subjects
from zmlcore.batch.objects import counts
from zmlcore.batch.store import BatchStore
from zmlcore.errors import MethodNotAllowedError, NotFoundError, PermissionDeniedError
from zmlcore.messages.batch import BatchEvent, BatchRecord, batch_event_decoder
from zmlcore.messages.warmup import RequestCompleted
from zmlcore.messages.placement import PlacementEvent
from zmlcore.messages.flow import ShareReport, share_report_decoder
from zmlcore.flowctl.bands import NAMES
from zmlcore.bus.direct import subscribe_direct
from zmlcore.bus.queueinfo import queue_depths
from zml_gateway.access import Access
from zml_gateway.asgi import Receive, Scope, Send
from zml_gateway.nodetable import NodeTable

log = logging.getLogger("zml.gateway.dashboard")

RATE_WINDOW_S = 10.0
STATS_WINDOW_S = 60.0
MAX_EVENTS = 50_000
CACHE_S = 0.5
#: Batches shown: the unfinished, then the most recently changed.
MAX_BATCHES = 20
#: How often the batch records are read again from the store (events keep them current between).
BATCH_READ_S = 5.0
#: A router replica's share report is shown this long after it came (replicas report every
#: [flow] share_report_ms while their counters move, and stop when nothing changes).
SHARES_KEEP_S = 60.0
#: Tenants listed in the flow panel, most tokens first.
MAX_TENANTS = 20

_FILES = {
    "/dashboard": ("dashboard.html", b"text/html; charset=utf-8"),
    "/dashboard/": ("dashboard.html", b"text/html; charset=utf-8"),
    "/dashboard/app.js": ("dashboard.js", b"text/javascript; charset=utf-8"),
    "/dashboard/app.css": ("dashboard.css", b"text/css; charset=utf-8"),
}
_SECURITY = [
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    # Everything comes from this origin: nothing from a CDN, no inline script.
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
]
_completed = msgspec.json.Decoder(RequestCompleted)
_placement = msgspec.json.Decoder(PlacementEvent)
#: Placement moves kept for the page (the latest first).
MAX_MOVES = 20
_TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))], 4)

    return {"n": len(s), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


class Dashboard:
    def __init__(self, nc: NATS, access: Access, table: NodeTable, *,
                 models: Callable[[], Iterable[str]] | None = None, batch_store: BatchStore | None = None) -> None:
        self.nc = nc
        self.access = access
        self.table = table
        #: The running config's models (zml.toml's and every node's): the queue panel's rows.
        self.models = models or (lambda: ())
        self.batch_store = batch_store
        #: (monotonic time received, family, node, ok, error code, ttft, latency)
        self.events: deque[tuple[float, str, str, bool, str, float | None, float | None]] = deque(maxlen=MAX_EVENTS)
        self._sub: Any = None
        self._batch_sub: Any = None
        #: batch id -> (unix time of its last change, the event or record it came from)
        self.batches: dict[str, tuple[float, BatchEvent]] = {}
        self._batches_read = -BATCH_READ_S
        self._files: dict[str, bytes] = {}
        self._cached: tuple[float, bytes] | None = None
        self._building: asyncio.Future[bytes] | None = None
        #: The placement planner's last plan and its latest moves (zml.events.placement).
        self.plan: PlacementEvent | None = None
        self.moves: deque[PlacementEvent] = deque(maxlen=MAX_MOVES)
        self._placement_sub: Any = None
        #: Flow control: each router replica's last share report (zml.flow.shares) and when it came.
        self.shares: dict[str, tuple[float, ShareReport]] = {}
        self._shares_sub: Any = None

    async def start(self) -> None:
        # One event per request of every router: taken in nats-py's reader, no task switch each
        # (zmlcore.bus.direct; the handler only appends to a deque).
        self._sub = await subscribe_direct(self.nc, subjects.event(subjects.EVENT_COMPLETED), self._on_completed)
        self._batch_sub = await self.nc.subscribe(subjects.BATCH_EVENTS, cb=self._on_batch)
        self._placement_sub = await self.nc.subscribe(subjects.event(subjects.EVENT_PLACEMENT), cb=self._on_placement)
        self._shares_sub = await self.nc.subscribe(subjects.FLOW_SHARES, cb=self._on_shares)

    async def stop(self) -> None:
        for sub in (self._sub, self._batch_sub, self._placement_sub, self._shares_sub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # connection already closing
                    pass

    async def _on_placement(self, msg: Msg) -> None:
        try:
            self.saw_placement(_placement.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return

    def saw_placement(self, ev: PlacementEvent) -> None:
        if ev.phase == "planned":
            self.plan = ev
        else:
            self.moves.appendleft(ev)

    def placement_view(self, now: float) -> dict[str, Any] | None:
        """The last plan ($/h now and planned, moves) and the latest moves; None before any plan
        (the planner is off, or no warmup service runs)."""
        if self.plan is None and not self.moves:
            return None
        p = self.plan
        return {
            "cost_now_per_h": p.cost_now_per_h if p else None, "cost_plan_per_h": p.cost_plan_per_h if p else None,
            "moves_planned": p.moves if p else None, "planned_s": round(max(0.0, now - p.ts), 1) if p else None,
            "moves": [{"phase": m.phase, "kind": m.kind, "node": m.node_id, "name": m.name, "message": m.message,
                       "age_s": round(max(0.0, now - m.ts), 1)} for m in self.moves],
        }

    async def _on_shares(self, msg: Msg) -> None:
        try:
            self.saw_shares(share_report_decoder.decode(msg.data), time.monotonic())
        except (msgspec.DecodeError, msgspec.ValidationError):
            return

    def saw_shares(self, report: ShareReport, now: float) -> None:
        old = self.shares.get(report.replica)
        if old is None or report.at >= old[1].at:
            self.shares[report.replica] = (now, report)

    def flow_view(self, now: float) -> dict[str, Any] | None:
        """Flow control across the router replicas (their share reports of the last
        ``SHARES_KEEP_S``): each tenant's part of the recent weighted tokens and its requests
        waiting in the saturation queue, and what waits by band. None: no replica reported (no
        flow control in use)."""
        for name in [r for r, (at, _) in self.shares.items() if now - at > SHARES_KEEP_S]:
            del self.shares[name]
        if not self.shares:
            return None
        tokens: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        bands: Counter[str] = Counter()
        for _, rep in self.shares.values():
            tokens.update(rep.tenants)
            waiting.update(rep.waiting)
            bands.update(rep.bands)
        total = sum(tokens.values())
        tenants = [{"tenant": t, "share": round(tokens[t] / total, 3) if total else 0.0,
                    "tokens": round(tokens[t]), "waiting": waiting.get(t, 0)}
                   for t in sorted(set(tokens) | set(waiting), key=lambda t: (-tokens[t], -waiting[t], t))]
        return {"replicas": len(self.shares), "tenants": tenants[:MAX_TENANTS],
                "tenants_not_shown": max(0, len(tenants) - MAX_TENANTS),
                "waiting_by_band": {b: bands[b] for b in NAMES if bands.get(b)}}

    async def _on_batch(self, msg: Msg) -> None:
        try:
            ev = batch_event_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.saw_batch(ev, ev.ts or time.time())

    def saw_batch(self, ev: BatchEvent, ts: float) -> None:
        old = self.batches.get(ev.batch_id)
        if old is not None and old[0] > ts:
            return  # a late event of an earlier state
        self.batches[ev.batch_id] = (ts, ev)
        if len(self.batches) > 4 * MAX_BATCHES:  # bounded: the finished and oldest go first
            keep = sorted(self.batches.items(), key=lambda kv: (kv[1][1].status not in _TERMINAL, kv[1][0]))
            self.batches = dict(keep[-MAX_BATCHES:])

    async def _read_batches(self) -> None:
        """Every batch's record from the store, every BATCH_READ_S: the page shows what `zml
        batches` lists, not only the batches whose events this gateway happened to hear."""
        now = time.monotonic()
        if self.batch_store is None or now - self._batches_read < BATCH_READ_S:
            return
        self._batches_read = now
        try:
            records = await self.batch_store.all_batches()
        except Exception:  # the page still shows the fleet when JetStream is slow
            log.debug("batch records not read", exc_info=True)
            return
        for rec in records:
            c = counts(rec)
            self.saw_batch(BatchEvent(batch_id=rec.id, status=rec.status, total=rec.total, completed=c.completed,
                                      failed=c.failed), _changed_at(rec))

    def batch_rows(self, now: float) -> list[dict[str, Any]]:
        """The unfinished batches, then the most recently changed (``now``: unix time)."""
        order = sorted(self.batches.values(), key=lambda x: (x[1].status not in _TERMINAL, x[0]), reverse=True)
        return [{"id": ev.batch_id, "status": ev.status, "total": ev.total, "completed": ev.completed,
                 "failed": ev.failed, "updated_s": round(max(0.0, now - ts), 1)} for ts, ev in order[:MAX_BATCHES]]

    def _on_completed(self, msg: Msg) -> None:
        try:
            ev = _completed.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        now = time.monotonic()
        events = self.events
        # Only the last STATS_WINDOW_S are ever shown: keep no more (MAX_EVENTS caps a burst).
        while events and now - events[0][0] > STATS_WINDOW_S:
            events.popleft()
        events.append((now, ev.family, ev.node_id, ev.ok, ev.error_code, ev.ttft_s, ev.latency_s))

    # --- HTTP ----------------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if scope["method"] != "GET":
            raise MethodNotAllowedError(f"{path[:80]} takes GET")
        if path == "/dashboard/state":
            await self.authorize(scope)
            body = await self.state_json()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), *_SECURITY]})
            await send({"type": "http.response.body", "body": body})
            return
        entry = _FILES.get(path)
        if entry is None:
            raise NotFoundError(f"no route {path[:80]}: the dashboard is at /dashboard")
        name, ctype = entry
        data = self._files.get(name)
        if data is None:
            data = self._files[name] = (resources.files("zml_gateway") / "static" / name).read_bytes()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype), *_SECURITY]})
        await send({"type": "http.response.body", "body": data})

    async def authorize(self, scope: Scope) -> None:
        """With keys on, the fleet's state is for operators: a zml.toml key ([gateway] api_keys),
        not a customer's run-time key (`zml keys create`), which gets 403."""
        caller = await self.access.authenticate(scope)  # 401 without a valid key
        if caller.record is not None:
            raise PermissionDeniedError("the dashboard wants an operator key ([gateway] api_keys in zml.toml), "
                                        "not a run-time API key")

    async def state_json(self) -> bytes:
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < CACHE_S:
            return self._cached[1]
        if self._building is not None:  # another poll is building it: share the result
            return await asyncio.shield(self._building)
        self._building = asyncio.get_running_loop().create_future()
        try:
            body = msgspec.json.encode(await self._state())
            self._cached = (time.monotonic(), body)
            self._building.set_result(body)
            return body
        except BaseException as exc:
            self._building.set_exception(exc)
            self._building.exception()  # retrieved: no "never retrieved" warning if nobody waits
            raise
        finally:
            self._building = None

    async def _state(self) -> dict[str, Any]:
        nodes, depths, _ = await asyncio.gather(self.table.rows(), self._queue(), self._read_batches())
        wall = time.time()
        rows = [node_row(n, wall) for n in nodes]
        queue, other = queue_rows(depths, self.models())
        return {"ts": wall, "nodes": rows, "queue": queue, "queue_other_models": other,
                "batches": self.batch_rows(wall), "placement": self.placement_view(wall),
                "flow": self.flow_view(time.monotonic()),
                **self.stats(time.monotonic())}

    async def _queue(self) -> dict[str, int]:
        try:
            return await queue_depths(self.nc)
        except Exception:  # the page still shows the fleet when JetStream is slow
            log.debug("queue depth not read", exc_info=True)
            return {}

    def stats(self, now: float) -> dict[str, Any]:
        by_family: Counter[str] = Counter()
        by_node: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        ttft: list[float] = []
        latency: list[float] = []
        served = 0
        for ts, family, node, ok, code, t1, lat in reversed(self.events):
            age = now - ts
            if age > STATS_WINDOW_S:
                break
            if age <= RATE_WINDOW_S and node:
                by_family[family] += 1
                by_node[node] += 1
            if ok:
                served += 1
                if t1 is not None:
                    ttft.append(t1)
            else:
                errors[code or "INTERNAL"] += 1
            if lat is not None:
                latency.append(lat)
        return {
            "rate_window_s": RATE_WINDOW_S,
            "stats_window_s": STATS_WINDOW_S,
            "decisions_per_s": {
                "total": round(sum(by_node.values()) / RATE_WINDOW_S, 2),
                "by_family": {k: round(v / RATE_WINDOW_S, 2) for k, v in sorted(by_family.items())},
                "by_node": {k: round(v / RATE_WINDOW_S, 2) for k, v in sorted(by_node.items())},
            },
            "served": served,
            "errors_by_code": dict(sorted(errors.items())),
            "ttft_s": percentiles(ttft),
            "latency_s": percentiles(latency),
        }


def _changed_at(rec: BatchRecord) -> float:
    return float(max(t for t in (rec.created_at, rec.in_progress_at, rec.finalizing_at, rec.completed_at,
                                 rec.failed_at, rec.expired_at, rec.cancelling_at, rec.cancelled_at) if t is not None))


def _age(now: float, at: Any) -> float | None:
    return round(max(0.0, now - at), 1) if isinstance(at, (int, float)) and at > 0 else None


def node_row(n: dict[str, Any], now: float) -> dict[str, Any]:
    """One node as the page shows it (``n``: a node table row), each belief with its source and
    age: the state the health service polled ``state_age_s`` ago (queue and speeds with it),
    why it is not up and since when, where its speeds come from and when they last moved."""
    status = n.get("status", "unknown")
    return {
        "node_id": n["node_id"], "accelerator_type": n.get("accelerator_type", ""),
        "family": n.get("family", ""), "engine": n.get("backend", "openai"),
        "status": status, "reason": n.get("reason", ""),
        "down_for_s": _age(now, n.get("last_ok")) if status in ("down", "invalid") else None,
        "state_age_s": _age(now, n.get("updated_at")),
        "health_score": n.get("health_score", 0.0),
        "queue_depth": n.get("queue_running", 0) + n.get("queue_waiting", 0),
        "in_flight": n.get("in_flight", 0), "cooldown_s": n.get("cooldown_s", 0.0),
        "saturated_s": n.get("saturated_s", 0.0), "price_per_hour": n.get("cost_per_hour", 0.0),
        "models": n.get("models", []), "missing_models": n.get("missing_models", []),
        "routers": n.get("routers", 0),
        "prefill_tps": n.get("prefill_tps", 0.0), "decode_tps": n.get("decode_tps", 0.0),
        # an older health service says only whether they were measured
        "speeds_source": n.get("speeds_source") or ("measured" if n.get("speeds_measured") else "default"),
        "speeds_age_s": _age(now, n.get("speeds_at")),
        "speeds_confidence": n.get("speeds_confidence") or None,
        "note": n.get("note", ""),
        "cache_fidelity": n.get("cache_fidelity", ""), "kv_events": n.get("kv_events", ""),
        "prefix_cache_hit_rate": n.get("prefix_cache_hit_rate"),
        "kv_block_size": n.get("kv_block_size", 0), "kv_blocks": n.get("kv_blocks", 0),
        # disaggregated prefill/decode: the legs it takes, its KV group and link
        "roles": n.get("roles") or [], "kv_group": n.get("kv_group", ""), "kv_gbps": n.get("kv_gbps", 0.0),
    }


def queue_rows(depths: dict[str, int], models: Iterable[str]) -> tuple[dict[str, int], int]:
    """The saturation queue by model name, for the running config's models (its consumers are
    durable: the queues of models an earlier config had stay in JetStream, keyed by hash), and
    what waits for other models."""
    names = {subjects.queue_key(m): m for m in models}
    shown = {m: 0 for m in sorted(names.values())}
    other = 0
    for key, depth in depths.items():
        if key in names:
            shown[names[key]] = depth
        else:
            other += depth
    return shown, other
