"""Control messages between router replicas, and their state reply.

- :class:`QueueBusy` on ``zml.queue_busy``: "model key K has requests waiting until T" (the
  holder of a saturation queue's head renews it), so new arrivals queue behind them instead of
  overtaking them when a slot frees. ``until = 0`` clears it.
- :class:`RouterState`: the answer on ``zml.admin.router.<id>.state`` and
  ``zml.admin.routers.state`` (each replica's view of every node: in flight, cooldowns).
"""

from __future__ import annotations

import msgspec


class QueueBusy(msgspec.Struct, frozen=True, kw_only=True):
    #: The model's queue key (zml_router.queue.jetstream.model_key).
    key: str
    #: Unix seconds until which arrivals for this model should queue (0: nothing waiting).
    until: float
    #: The highest band the announcing replica holds waiting (zmlcore.flowctl.bands; 9: not
    #: said), and which replica it is: a replica holding only lower bands leaves a freed slot to
    #: it (zml_router.queue.jetstream).
    band: int = 9
    router: str = ""
    #: That best entry is an over-share tenant's (zmlcore.flowctl.order): a replica holding a
    #: within-share entry of the same band goes first.
    over: bool = False
    #: How many entries of the model the announcing replica holds: the nodes' spare slots are
    #: shared among the holders by it (zmlcore.flowctl.gate.spare_part). 0: not said.
    held: int = 0


class RouterNodeState(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str
    #: In flight on the node, every replica's counts (own + peers').
    outstanding: int
    pending: int
    #: This replica's own [outstanding, pending].
    own: list[int]
    effective_outstanding: int
    cooldown_s: float
    saturated_s: float
    #: Seconds since health last wrote the node's state.
    state_age_s: float
    cost_per_hour: float
    #: Why the node is cooling down, and which replica said so (only while it is).
    cooldown_reason: str = ""
    cooldown_by: str = ""


class RouterState(msgspec.Struct, kw_only=True):
    router_id: str
    #: Requests this replica is serving now.
    in_flight: int
    nodes: dict[str, RouterNodeState]
    #: A token drawn at each start: a router restarted under the same id (`zml up` names them)
    #: is another incarnation and holds nothing of the last one's (its request id claims).
    incarnation: str = ""


queue_busy_decoder = msgspec.json.Decoder(QueueBusy)
router_state_decoder = msgspec.json.Decoder(RouterState)


class DecisionFamily(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One accelerator family of the policy's chain, as the decision evaluated it."""

    family: str
    nodes_checked: int
    #: Why no node of it was taken ("" when one was, or the chain stopped before it).
    rejected_reason: str = ""


class DecisionRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One routing decision, as the replica that made it remembers it: the answer on
    ``zml.admin.routers.decision`` (``zml why``, ``GET /v1/decisions/{id}``).

    What the router believed when it chose (the node's speeds with their source and age, the
    cached prefix, the estimate) beside what then happened, so a slow reply can be read back
    to the belief that sent it there."""

    decision_id: str
    router_id: str
    request_id: str
    #: Unix time of the decision.
    at: float
    model: str
    policy: str
    node_id: str
    accelerator_type: str
    family: str
    #: Dispatch attempt of the request this decision was (1 = first; more after a failover).
    attempt: int
    #: Requests in flight on the node when it was chosen.
    queue_depth: int
    #: The router's estimate of the time to first token on this node, seconds.
    estimated_ttft_s: float
    #: Prompt tokens the router believed the node held in its prefix cache.
    cached_tokens_estimated: int = 0
    #: Session affinity: "kept", "spilled", "moved" or "" (no session).
    session: str = ""
    #: The node's speeds the decision read: prompt and output tokens/s, where they came from
    #: ("measured", "learned", "default"...), when, and how sure.
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    speeds_source: str = ""
    speeds_at: float = 0.0
    speeds_confidence: float = 0.0
    evaluated: list[DecisionFamily] = []
    #: What happened, as far as this replica knows now: "in_flight", "ok", "failed" (then
    #: ``error_code``), or "moved" (a later attempt went to another node).
    outcome: str = "in_flight"
    error_code: str = ""
    #: Observed seconds from the router receiving the request to its first token.
    time_to_first_token: float | None = None


class DecisionQuery(msgspec.Struct, kw_only=True):
    decision_id: str


decision_record_decoder = msgspec.json.Decoder(DecisionRecord)
decision_query_decoder = msgspec.json.Decoder(DecisionQuery)
