"""msgspec Structs for every message ZML puts on the wire."""

from zmlcore.messages.cost import CostEntry, cost_entry_decoder
from zmlcore.messages.infer import (
    ZML_REQUEST_KEYS,
    ChatMessage,
    InferRequest,
    InlinePolicy,
    ROUTING_HEADER_WORDS,
    RoutingInfo,
    StreamStart,
    infer_request_decoder,
    routing_info_decoder,
)
from zmlcore.messages.admin import NodeAdd, NodeAdded, NodeRemove, NodeRemoved, NodeSpec, RegistryEntry
from zmlcore.messages.node import (
    InflightDelta,
    InflightSnapshot,
    NodeMark,
    NodeState,
    NodeStatus,
    node_mark_decoder,
    node_state_decoder,
)
from zmlcore.messages.router import (
    QueueBusy,
    RouterNodeState,
    RouterState,
    queue_busy_decoder,
    router_state_decoder,
)
from zmlcore.messages.warmup import (
    RequestCompleted,
    ServeReply,
    ServeRequest,
    ServeTarget,
    WarmupEvent,
)

__all__ = [
    "QueueBusy",
    "RouterNodeState",
    "RouterState",
    "queue_busy_decoder",
    "router_state_decoder",
    "ZML_REQUEST_KEYS",
    "ROUTING_HEADER_WORDS",
    "ChatMessage",
    "CostEntry",
    "InferRequest",
    "InflightDelta",
    "InflightSnapshot",
    "InlinePolicy",
    "NodeAdd",
    "NodeAdded",
    "NodeMark",
    "NodeRemove",
    "NodeRemoved",
    "NodeSpec",
    "NodeState",
    "NodeStatus",
    "RegistryEntry",
    "RequestCompleted",
    "RoutingInfo",
    "ServeReply",
    "ServeRequest",
    "ServeTarget",
    "StreamStart",
    "WarmupEvent",
    "cost_entry_decoder",
    "infer_request_decoder",
    "node_mark_decoder",
    "node_state_decoder",
    "routing_info_decoder",
]
