"""When a polled node state goes to the KV bucket: on a meaningful change, else as a heartbeat.

Writing every node every poll costs JetStream a write (and every router, gateway and warmup a
decode and an index update) per node per poll: 200 writes/s at 1,000 nodes and the default
5 s interval, almost all of them saying "nothing changed". A state is written when something a
reader acts on changed (status, models, queue, speeds by more than 2%...), and otherwise often
enough that the written state is never older than ``heartbeat_s`` when the next poll comes:
readers judge freshness by ``updated_at`` (``router.stale_after_s``), so a node whose health
service died still goes stale, and a live one never does. With the default 5 s polls and 15 s
staleness bound that is still about every poll; with faster polls (fresher queues at scale)
writes follow changes, not polls. Sans-I/O: the service asks :meth:`Writes.due` after each
poll and reports :meth:`Writes.wrote` once the put succeeded.
"""

from __future__ import annotations

from zmlcore.messages import NodeState

#: Fields compared exactly: what routers route by and what warmup acts on.
EXACT = (
    "accelerator_type", "family", "endpoint", "backend", "status", "reason", "models", "served_names",
    "missing_models", "unknown_models", "loading_models", "draining_models", "adapters", "sleeping", "queue_running", "queue_waiting",
    "max_concurrency", "speeds_measured", "speeds_source",
    "cost_per_hour", "consecutive_failures", "driver_version", "device_count", "memory_gib", "note", "source",
    "poll_interval_s", "roles", "kv_group", "kv_gbps", "kv_bootstrap_port",
)
#: Fields that change a little on every poll: (field, relative tolerance, absolute tolerance).
#: A change beyond either is meaningful. Speeds: the estimate's own resolution (2%).
NEAR = (
    ("prefill_tps", 0.02, 0.0),
    ("decode_tps", 0.02, 0.0),
    # routers explore a node in proportion to its uncertainty: a calibrated node goes out now
    ("speeds_confidence", 0.0, 0.1),
    ("health_score", 0.0, 1.0),
    ("error_rate", 0.0, 0.01),
    ("kv_cache_usage", 0.0, 0.05),
    ("free_memory_gib", 0.0, 0.5),
    ("requests_per_s", 0.10, 0.05),
    ("tokens_per_s", 0.10, 0.5),
    ("ttft_s", 0.10, 0.0),
    ("last_inference_at", 0.0, 1.0),
)
#: Per model in ``model_speeds`` (what routers route a model by): (field, relative tolerance).
MODEL_NEAR = (
    ("prefill_tps", 0.02),
    ("decode_tps", 0.02),
    ("decode_slowdown", 0.10),
    ("ttft_overhead_s", 0.10),
    ("full_decode_s", 0.10),
)
# Not compared (refreshed by the heartbeat): updated_at, last_ok, tokens_per_s_history, age_s,
# speeds_at (it moves with the speeds, which are compared), prefill_sigma and decode_sigma (with
# speeds_confidence), decode_slowdown (but per model), model_speeds' other fields.


def effective_heartbeat(heartbeat_s: float, stale_after_s: float) -> float:
    """At most a third of the readers' staleness bound, so one lost write never makes a live
    node stale."""
    return min(heartbeat_s, stale_after_s / 3.0)


def meaningful_change(old: NodeState, new: NodeState) -> str | None:
    """The first field whose change readers must see now, or None."""
    for f in EXACT:
        if getattr(old, f) != getattr(new, f):
            return f
    for f, rel, ab in NEAR:
        a, b = getattr(old, f), getattr(new, f)
        if a == b:
            continue
        if a is None or b is None:
            return f
        d = abs(a - b)
        if (ab and d >= ab) or (rel and d > rel * max(abs(a), abs(b))):
            return f
    if old.model_speeds != new.model_speeds:
        if old.model_speeds.keys() != new.model_speeds.keys():
            return "model_speeds"
        for m, ms in new.model_speeds.items():
            was = old.model_speeds[m]
            for f, rel in MODEL_NEAR:
                a, b = getattr(was, f), getattr(ms, f)
                if a != b and abs(a - b) > rel * max(abs(a), abs(b)):
                    return "model_speeds"
    return None


class Writes:
    """The last state written per node and when."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._last: dict[str, tuple[NodeState, float]] = {}
        #: writes skipped because nothing meaningful changed (a metric for the bench and tests)
        self.skipped = 0

    def due(self, state: NodeState, now: float, next_poll_s: float) -> str | None:
        """Why ``state`` must be written now ("new", a field name, "heartbeat"), or None.
        ``next_poll_s``: the longest wait until this node's next poll (interval + jitter)."""
        last = self._last.get(state.node_id)
        if last is None:
            return "new"
        prev, at = last
        why = meaningful_change(prev, state)
        if why is not None:
            return why
        if now + next_poll_s - at > self.heartbeat_s:
            return "heartbeat"
        self.skipped += 1
        return None

    def wrote(self, state: NodeState, now: float) -> None:
        self._last[state.node_id] = (state, now)

    def forget_all(self) -> None:
        """After a reconnect: the broker may have restarted without the bucket, so every
        node's next state is written at once."""
        self._last.clear()

    def forget(self, node_id: str) -> None:
        """The node was removed or re-registered: its next state is written at once."""
        self._last.pop(node_id, None)
