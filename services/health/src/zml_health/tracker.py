"""Per-node health state machine, counters and error rate (pure: time is passed in).

* A node that has never answered is ``loading`` during its start-up grace window, and so is a
  node whose engine says it is loading (SGLang/llama.cpp 503).
* ``down`` after ``down_after`` consecutive failed probes; back ``up`` after ``up_after``
  consecutive good ones (flapping suppression). One failed or slow probe does not change the
  status of an up node; a slow probe (timeout) is not counted in the error rate either.
* The error rate is the larger of the failed-probe share and the node-error share of the
  routers' completion events, both over ``error_window_s``.
* Counters (tokens, requests, TTFT histogram) become rates from one poll to the next; a counter
  that goes backwards means the engine restarted, and starts over.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zmlcore.config import HealthConfig
from zml_health.score import health_score
from zml_health.speed import Readings, SpeedMeter
from zmlcore.messages import NodeStatus

from zml_health.adapters.base import Probe

__all__ = ["Tracker", "health_score"]

#: Events needed in the window before the request error rate counts (one error in two
#: requests says little).
MIN_EVENTS = 5


@dataclass(slots=True)
class Tracker:
    started_at: float
    grace_s: float
    history_len: int = 12
    status: NodeStatus = "unknown"
    ever_ok: bool = False
    fails: int = 0
    oks: int = 0
    last_ok: float = 0.0
    reason: str = ""
    polls: int = 0
    #: (time, failed) per probe; slow and loading probes are not recorded.
    probes: deque[tuple[float, bool]] = field(default_factory=deque)
    #: Router completion events on this node as [unix second, events, node errors] buckets:
    #: O(1) per event and bounded by the error window (not one entry per request: 240,000 per
    #: node a minute at 4,000 req/s).
    events: deque[list[int]] = field(default_factory=deque)
    last_poll_at: float = 0.0
    last_tokens: float | None = None
    last_requests: float | None = None
    last_ttft: tuple[float, float] | None = None
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    ttft_s: float | None = None
    last_inference_at: float = 0.0
    history: deque[float] = field(default_factory=deque)
    #: Prefill/decode speeds measured from the engine's counters (vLLM, llama.cpp), when it reports them.
    speed: SpeedMeter = field(default_factory=SpeedMeter)
    #: When the measured speeds last moved (a counter window with enough tokens); 0: never.
    speed_at: float = 0.0
    #: Last time a router abandoned a request here for want of a first byte (completion
    #: events' ``slow_nodes``): its probes may pass while inference hangs.
    last_slow_at: float = 0.0
    #: The engine's prefix-cache counters at the last poll (queries, hits), and the hit rate of
    #: the last window in which it looked up any prompt.
    last_prefix: tuple[float, float] | None = None
    prefix_hit_rate: float | None = None
    #: Times the engine's counters went backwards (it restarted): its learned speeds start over.
    restarts: int = 0

    def slow_note(self, now: float, window: float) -> str:
        if not self.last_slow_at or now - self.last_slow_at > window:
            return ""
        return f"slow: a router got no first byte in time {now - self.last_slow_at:.0f} s ago"

    def slowed(self, score: float, now: float, window: float) -> float:
        """A node found slow within the error window scores at most half (its probes pass
        while inference hangs; the routers' error share only counts after MIN_EVENTS)."""
        if self.last_slow_at and now - self.last_slow_at <= window:
            return round(score / 2, 1)
        return score

    def error_rate(self, now: float, window: float) -> float:
        self._trim(now, window)
        probe_rate = sum(1 for _, f in self.probes if f) / len(self.probes) if self.probes else 0.0
        req_rate = 0.0
        n = sum(b[1] for b in self.events)
        if n >= MIN_EVENTS:
            req_rate = sum(b[2] for b in self.events) / n
        return max(probe_rate, req_rate)

    def _trim(self, now: float, window: float) -> None:
        probes, events = self.probes, self.events
        while probes and probes[0][0] < now - window:
            probes.popleft()
        while events and events[0][0] + 1 <= now - window:  # the whole second is out
            events.popleft()

    def record_request(self, ts: float, ok: bool, node_error: bool) -> None:
        """A router's completion event for this node."""
        sec = int(ts)
        events = self.events
        if events and events[-1][0] >= sec:  # this second (or a router whose clock lags a little)
            b = events[-1]
        else:
            b = [sec, 0, 0]
            events.append(b)
        b[1] += 1
        b[2] += node_error
        if ok:
            self.last_inference_at = max(self.last_inference_at, ts)

    def observe(self, probe: Probe, now: float, cfg: HealthConfig) -> NodeStatus:
        self.polls += 1
        if probe.ok:
            self._observe_ok(probe, now, cfg)
        else:
            self._observe_failure(probe, now, cfg)
        self._trim(now, cfg.error_window_s)
        return self.status

    def _observe_ok(self, probe: Probe, now: float, cfg: HealthConfig) -> None:
        self.probes.append((now, False))
        self.oks += 1
        self.fails = 0
        self.last_ok = now
        self.reason = ""
        if self.status != "down" or self.oks >= cfg.up_after:
            self.status = "up"
        self.ever_ok = True
        self._rates(probe, now)

    def _observe_failure(self, probe: Probe, now: float, cfg: HealthConfig) -> None:
        self.oks = 0
        self.reason = probe.error
        if probe.loading or (not self.ever_ok and now - self.started_at < self.grace_s):
            # The engine is starting: neither a failure nor a reason to route to it.
            self.fails = 0
            self.status = "loading"
            return
        self.fails += 1
        if not probe.slow:
            self.probes.append((now, True))
        if self.fails >= cfg.down_after or self.status in ("unknown", "loading"):
            self.status = "down"

    def _rates(self, probe: Probe, now: float) -> None:
        dt = now - self.last_poll_at if self.last_poll_at else 0.0
        self.last_poll_at = now
        tok = probe.generation_tokens_total
        if tok is not None and self.last_tokens is not None and tok < self.last_tokens:
            self.restarts += 1
        if tok is not None:
            if self.last_tokens is not None and dt > 0 and tok >= self.last_tokens:
                self.tokens_per_s = (tok - self.last_tokens) / dt
                if tok > self.last_tokens:
                    self.last_inference_at = max(self.last_inference_at, now)
            self.last_tokens = tok
        req = probe.requests_ok_total
        if req is not None:
            if self.last_requests is not None and dt > 0 and req >= self.last_requests:
                self.requests_per_s = (req - self.last_requests) / dt
            self.last_requests = req
        if probe.ttft_sum is not None and probe.ttft_count is not None:
            if self.last_ttft is not None and probe.ttft_count > self.last_ttft[1]:
                self.ttft_s = (probe.ttft_sum - self.last_ttft[0]) / (probe.ttft_count - self.last_ttft[1])
            self.last_ttft = (probe.ttft_sum, probe.ttft_count)
        readings = (probe.prompt_tokens_total, probe.prefill_time_sum, probe.request_gen_tokens_sum,
                    probe.request_gen_tokens_count, probe.decode_time_sum)
        if all(v is not None for v in readings):
            before = (self.speed.prefill_tps, self.speed.decode_tps)
            self.speed.observe(Readings(*readings, probe.decode_steps_total,  # type: ignore[arg-type]
                                        probe.busy_slot_steps_total), probe.running)
            if (self.speed.prefill_tps, self.speed.decode_tps) != before:
                self.speed_at = now
        q, h = probe.prefix_queries_total, probe.prefix_hits_total
        if q is not None and h is not None:
            prev = self.last_prefix
            if prev is not None and q > prev[0] and h >= prev[1]:
                self.prefix_hit_rate = min(1.0, (h - prev[1]) / (q - prev[0]))
            elif prev is not None and q < prev[0]:  # counters reset: the engine restarted
                self.prefix_hit_rate = None
            self.last_prefix = (q, h)
        self.history.append(round(self.tokens_per_s, 3))
        while len(self.history) > self.history_len:
            self.history.popleft()
