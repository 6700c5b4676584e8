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


queue_busy_decoder = msgspec.json.Decoder(QueueBusy)
router_state_decoder = msgspec.json.Decoder(RouterState)
