"""msgspec Structs for every message ZML puts on the wire."""

from zmlcore.messages.infer import (
    ZML_REQUEST_KEYS,
    ChatMessage,
    InferRequest,
    InlinePolicy,
    RoutingInfo,
    StreamStart,
    infer_request_decoder,
    routing_info_decoder,
)
from zmlcore.messages.node import InflightDelta, NodeState, NodeStatus, node_state_decoder

__all__ = [
    "ZML_REQUEST_KEYS",
    "ChatMessage",
    "InferRequest",
    "InflightDelta",
    "InlinePolicy",
    "NodeState",
    "NodeStatus",
    "RoutingInfo",
    "StreamStart",
    "infer_request_decoder",
    "node_state_decoder",
    "routing_info_decoder",
]
