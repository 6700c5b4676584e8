"""The router's Prometheus metrics (docs/observability.md lists them all).

The six a request bumps (requests, decisions, decision time, TTFT, duration, tokens) are tallies
(``zmlcore.telemetry.tally``: plain numbers per label set, folded into the same Prometheus families when
``/metrics`` is scraped); the rare ones (failovers, retries, queue) are prometheus_client
metrics through cached label children; the per-node gauges and the saturation queue's depth are
read from the node table at scrape time (a collector), so they cost the request path nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sized
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from zmlcore.telemetry.metrics import (
    DECISION_BUCKETS,
    DURATION_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    WAIT_BUCKETS,
    Children,
)
from zmlcore import subjects
from zmlcore.telemetry import tracing
from zmlcore.telemetry.tally import CounterTally, HistogramTally, Tallies
from zmlcore.bus.queueinfo import queue_depths
from zmlcore.config import ZMLConfig
from zmlcore.messages import RoutingInfo
from zmlcore.policy import Decision, RouteRequest
from zmlcore.telemetry.setup import REQUEST_ID
from zml_router.telemetry import tracing as rtrace
from zml_router.replicas.table import NodeTable

if TYPE_CHECKING:
    from zml_router.outcome import Outcome as _Outcome

log = logging.getLogger("zml.router.metrics")

#: GenAI operation names (gen_ai.operation.name) for the two request kinds.
OPERATION = {"chat": "chat", "completion": "text_completion"}

REQUESTS = CounterTally(
    "zml_router_requests", "Requests finished by this router, by outcome (code OK or the ZML error code).",
    ["model", "policy", "family", "node", "code"])
TTFT = HistogramTally(
    "gen_ai_server_time_to_first_token_seconds",
    "Time from the router receiving a request to the first token (the whole reply when not streamed).",
    ["gen_ai_operation_name", "gen_ai_request_model", "zml_family", "zml_node"], buckets=TTFT_BUCKETS)
DURATION = HistogramTally(
    "gen_ai_server_request_duration_seconds", "End-to-end request duration at the router (error_type set on failures).",
    ["gen_ai_operation_name", "gen_ai_request_model", "zml_family", "zml_node", "error_type"],
    buckets=DURATION_BUCKETS)
TOKENS = HistogramTally(
    "gen_ai_client_token_usage", "Tokens per request as the node reported them (input and output).",
    ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"], buckets=TOKEN_BUCKETS)
DECISION_TIME = HistogramTally(
    "zml_router_decision_seconds", "Time to choose a node (policy maths on the local table).", ["policy"],
    buckets=DECISION_BUCKETS)
DECISIONS = CounterTally(
    "zml_router_decisions", "Routing decisions: policy -> family -> node chosen (failover attempts included).",
    ["policy", "family", "node"])
REGISTRY.register(Tallies(REQUESTS, TTFT, DURATION, TOKENS, DECISION_TIME, DECISIONS))
FAILOVERS = Children(Counter(
    "zml_router_failovers",
    "Attempts that failed before the first token and were re-routed or given up, by node and cause "
    "(network, server, slow, overloaded, no_model, client).", ["node", "cause"]))
RETRIES = Children(Counter(
    "zml_router_retries", "Requests served on a second or later attempt, by the node that served them.", ["node"]))
TAKEN_OVER = Children(Counter(
    "zml_router_taken_over",
    "Requests sent again by their requester (Zml-Resend: the router holding them went silent, the requester's "
    "broker connection came back, or a stream lost a message), served here; previous: 'other' (held by another "
    "replica, or by none) or 'self' (held here).", ["previous"]))
FLOW = Children(Counter(
    "zml_router_flow_requests",
    "Requests under flow control (a band, a target or [flow] settings: docs/routing.md 'Flow control'), by band and "
    "outcome: ok, SLO_UNATTAINABLE (refused up front), SHED, or another error code.", ["band", "outcome"]))
FLOW_SLO = Children(Counter(
    "zml_router_flow_slo",
    "Whole replies to requests with a latency target, by band and result (met, missed): the attainment.",
    ["band", "result"]))
FLOW_QUEUED = Children(Histogram(
    "zml_router_flow_queue_wait_seconds", "Time requests under flow control waited in the saturation queue, by band.",
    ["band"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)))
QUEUED = Children(Counter(
    "zml_router_queue_enqueued", "Requests put in the saturation queue.", ["model"]))
QUEUE_EXPIRED = Children(Counter(
    "zml_router_queue_expired", "Queued requests answered QUEUE_FULL because no node had room within max_queue_ms.",
    ["model"]))
PREFIX_TOKENS = Children(Counter(
    "zml_prefix_cache_tokens",
    "Prompt tokens of requests whose engine reported its prefix cache, by node and kind: prompt (all of "
    "them), estimated (what the router estimated the node held when it chose it), reported (what the engine "
    "said it served from its cache). reported / prompt is the fleet's hit rate; estimated vs reported, the "
    "index's accuracy.", ["node", "kind"]))
SESSIONS = Children(Counter(
    "zml_prefix_cache_sessions",
    "Requests of a session bound to a node, by outcome: kept (the bound node took it), spilled (over its "
    "load bound: the policy chose), moved (the bound node could not take it: down, cooling, not serving).",
    ["outcome"]))
SPLITS = Children(Counter(
    "zml_router_split_decisions",
    "Disaggregation decisions ([disaggregation] enabled), by outcome: split (a prefill leg, then a decode leg), "
    "or why the request was served whole: short_prompt, no_pair, whole_better, over_bound (the split over "
    "the admission bound), slo (the split estimated to miss a target of the request's whole meets).", ["outcome"]))
PREFILL_LEGS = Children(Counter(
    "zml_router_prefill_legs",
    "Prefill legs of split requests by prefill node and result: ok, or the failure (network, server, slow, "
    "overloaded...) after which the request was served whole on its decode node.", ["node", "result"]))
#: A tally (a bisect and two additions per attempt), not a prometheus_client Histogram (its lock
#: and child lookup cost ~2 us per request on the router's path; issue 28's CPU budget).
PREDICTION = HistogramTally(
    "zml_router_ttft_prediction_ratio",
    "Observed over predicted time to first token of each attempt that got one, by node: the TTFT estimated at "
    "dispatch from the node's learned speeds (the x-zml-predicted-ttft-ms header) against what came (1: exact; "
    "0.8-1.25: within 25%).", ["node"],
    buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0))
REGISTRY.register(Tallies(PREDICTION))
QUEUE_WAIT = Children(Histogram(
    "zml_router_queue_wait_seconds", "Time a queued request waited until a node had room for it.", ["model"],
    buckets=WAIT_BUCKETS))

class _ModelOnly(msgspec.Struct):
    model: str = ""


_model_only = msgspec.json.Decoder(_ModelOnly)

QUEUE_PROBE_S = 2.0


class RouterMetrics(Collector):
    """Hooks the request path calls, and the scrape-time view of the router's table.

    ``in_flight``: the requests the router handles now (read at scrape time)."""

    def __init__(self, cfg: ZMLConfig, table: NodeTable, in_flight: Sized) -> None:
        self.cfg = cfg
        self.table = table
        self.in_flight = in_flight
        self.nc: NATS | None = None
        #: model key -> messages waiting in the shared saturation queue (polled, not per request).
        self.queue_depth: dict[str, int] = {}
        self._probe: asyncio.Task[None] | None = None
        #: The router's prefix index (zmlcore.policy.prefix.PrefixIndex), read at scrape time.
        self.prefix: Any = None
        _VIEW.service = self

    # --- request path ----------------------------------------------------------------------
    def decide(self, decide: Callable[..., Decision], rr: RouteRequest, *args: Any) -> Decision:
        t = time.perf_counter()
        d = decide(rr, *args)
        DECISION_TIME.observe((d.policy,), time.perf_counter() - t)
        DECISIONS.inc((d.policy, d.family, d.node_id))
        if tracing.ON:
            rtrace.decided(d, rr)
        return d

    def dispatching(self, headers: dict[str, str], info: RoutingInfo) -> None:
        if tracing.ON:
            rtrace.dispatching(headers, info.decision_id)

    def cached(self, node_id: str, prompt: int, estimated: int | None, reported: int) -> None:
        """The engine reported ``reported`` of the request's ``prompt`` tokens cached."""
        PREFIX_TOKENS(node_id, "prompt").inc(prompt)
        PREFIX_TOKENS(node_id, "reported").inc(reported)
        if estimated is not None:
            PREFIX_TOKENS(node_id, "estimated").inc(estimated)
        if tracing.ON:
            rtrace.cached(estimated, reported)

    def predicted(self, node_id: str, predicted_s: float, observed_s: float) -> None:
        """An attempt's TTFT against the one predicted at dispatch."""
        if predicted_s > 0:
            PREDICTION.observe((node_id,), observed_s / predicted_s)
        if tracing.ON:
            rtrace.predicted(predicted_s, observed_s)

    def session(self, outcome: str) -> None:
        if outcome:
            SESSIONS(outcome).inc()

    def split(self, outcome: str) -> None:
        SPLITS(outcome).inc()

    def prefill_leg(self, node_id: str, result: str) -> None:
        PREFILL_LEGS(node_id, result).inc()

    def failover(self, node_id: str, cause: str) -> None:
        FAILOVERS(node_id, cause).inc()
        if tracing.ON:
            rtrace.failed(cause)

    def usage_dict(self, op: str, model: str, usage: dict[str, Any]) -> None:
        for key, kind in (("prompt_tokens", "input"), ("completion_tokens", "output")):
            n = usage.get(key)
            if isinstance(n, int):
                TOKENS.observe((OPERATION.get(op, op), model, kind), n)
        if tracing.ON:
            p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
            rtrace.usage(p if isinstance(p, int) else None, c if isinstance(c, int) else None)

    def finished(self, out: "_Outcome", elapsed: float) -> None:
        if tracing.ON:
            rtrace.finished(out, REQUEST_ID.get())
        if out.queued:
            return  # counted when served (or expired)
        info = out.info
        policy = info.policy if info is not None else ""
        code = "OK" if out.ok else (out.error_code or "INTERNAL")
        REQUESTS.inc((out.model, policy, out.family, out.node_id, code))
        op = OPERATION.get(out.op, out.op)
        DURATION.observe((op, out.model, out.family, out.node_id, "" if out.ok else code), elapsed)
        note = out.flow
        if note is not None:
            band = note.ask.band_name
            FLOW(band, "ok" if out.ok else code).inc()
            if note.queued_ms is not None:
                FLOW_QUEUED(band).observe(note.queued_ms / 1000.0)
            if info is not None and info.slo in ("met", "missed"):
                FLOW_SLO(band, info.slo).inc()
        if out.ok and info is not None:
            if info.time_to_first_token is not None:
                TTFT.observe((op, out.model, out.family, out.node_id), info.time_to_first_token)
            if out.attempts > 1:
                RETRIES(out.node_id).inc()

    def taken_over(self, previous: str) -> None:
        TAKEN_OVER(previous).inc()

    def enqueued(self, model: str, headers: dict[str, str]) -> None:
        """Before the request goes into the queue: its trace context goes with it."""
        QUEUED(model).inc()
        if tracing.ON:
            tracing.inject(headers)

    def waited(self, model: str, headers: dict[str, str]) -> None:
        now = time.time()
        try:
            enqueued = float(headers.get(subjects.H_QUEUE_ENQUEUED, now))
        except ValueError:
            enqueued = now
        QUEUE_WAIT(model).observe(max(0.0, now - enqueued))
        if tracing.ON:
            rtrace.queue_waited(headers, enqueued, now)

    def expired(self, data: bytes) -> None:
        try:
            model = self.cfg.resolve_model(_model_only.decode(data).model)
        except (msgspec.DecodeError, msgspec.ValidationError):
            model = ""
        QUEUE_EXPIRED(model).inc()

    # --- the saturation queue's depth (JetStream consumer info, every QUEUE_PROBE_S) -----------
    def start(self, nc: NATS) -> None:
        self.nc = nc
        self._probe = asyncio.create_task(self._probe_queue())

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)

    async def _probe_queue(self) -> None:
        while True:
            await asyncio.sleep(QUEUE_PROBE_S)
            nc = self.nc
            if nc is None or not nc.is_connected:
                continue
            try:
                self.queue_depth = await queue_depths(nc)
            except asyncio.CancelledError:
                raise
            except Exception:  # the queue stream may not exist yet; a statistic is never fatal
                log.debug("queue depth not read", exc_info=True)

    # --- scrape time ---------------------------------------------------------------------------
    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.time()
        labels = ["node", "family", "accelerator_type", "engine"]
        state = GaugeMetricFamily("zml_node_state", "1 for the node's current status (up, down, loading, ...).",
                                  labels=[*labels, "status"])
        gauges = {
            "score": GaugeMetricFamily("zml_node_health_score", "Health score (0-100) from the health service.", labels=labels),
            "queue": GaugeMetricFamily("zml_node_queue_depth", "Requests running plus waiting on the node (last poll).",
                                       labels=labels),
            "inflight": GaugeMetricFamily("zml_node_in_flight",
                                          "Requests dispatched to the node and not finished (all routers, as this one sees it).",
                                          labels=labels),
            "cooldown": GaugeMetricFamily("zml_node_cooldown_seconds", "Seconds left before a failed node is tried again.",
                                          labels=labels),
            "saturated": GaugeMetricFamily("zml_node_saturated_seconds",
                                           "Seconds left before an overloaded node is tried again.", labels=labels),
            "price": GaugeMetricFamily("zml_node_price_per_hour", "The node's price (run-time costs applied).", labels=labels),
        }
        for v in list(self.table.views.values()):
            st = v.state
            lv = [v.node_id, st.family, st.accelerator_type, st.backend]
            state.add_metric([*lv, st.status], 1.0)
            gauges["score"].add_metric(lv, st.health_score)
            gauges["queue"].add_metric(lv, st.queue_running + st.queue_waiting)
            gauges["inflight"].add_metric(lv, v.effective_outstanding())
            gauges["cooldown"].add_metric(lv, max(0.0, v.cooldown_until - now))
            gauges["saturated"].add_metric(lv, max(0.0, v.saturated_until - now))
            gauges["price"].add_metric(lv, st.cost_per_hour)
        yield state
        yield from gauges.values()
        depth = GaugeMetricFamily("zml_router_queue_depth", "Requests waiting in the saturation queue (all routers).",
                                  labels=["queue"])
        for key, n in sorted(self.queue_depth.items()):
            depth.add_metric([key], n)
        yield depth
        yield GaugeMetricFamily("zml_router_in_flight", "Requests this router is handling now.",
                                value=len(self.in_flight))
        if self.prefix is not None:
            entries = GaugeMetricFamily(
                "zml_prefix_cache_index_entries",
                "Prompt-prefix keys this router's index holds for the node (shared with every replica).",
                labels=["node"])
            for v in list(self.table.views.values()):
                nc = self.prefix.node(v.node_id)
                if nc is not None:
                    entries.add_metric([v.node_id], len(nc))
            yield entries


class _View(Collector):
    """Registered once per process; forwards to the router service of the moment (tests build
    several in one process, and a registry refuses the same metric names twice)."""

    service: RouterMetrics | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.service is not None:
            yield from self.service.collect()


_VIEW = _View()
REGISTRY.register(_VIEW)
