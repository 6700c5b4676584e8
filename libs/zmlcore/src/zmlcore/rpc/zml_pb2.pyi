from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferRequest(_message.Message):
    __slots__ = ("model", "messages", "prompt", "prompts", "max_tokens", "temperature", "policy", "inline_policy", "routing", "accelerator_id", "request_id", "timeout_ms", "extra_json")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INLINE_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    temperature: float
    policy: str
    inline_policy: Policy
    routing: str
    accelerator_id: str
    request_id: str
    timeout_ms: int
    extra_json: bytes
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., policy: _Optional[str] = ..., inline_policy: _Optional[_Union[Policy, _Mapping]] = ..., routing: _Optional[str] = ..., accelerator_id: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., extra_json: _Optional[bytes] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("name", "strategy", "accelerator_chain", "latency_target_ms", "cost_priority", "latency_weight", "cost_weight", "queue_threshold", "queue_on_saturation", "max_queue_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CHAIN_FIELD_NUMBER: _ClassVar[int]
    LATENCY_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    COST_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COST_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ON_SATURATION_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    strategy: str
    accelerator_chain: _containers.RepeatedScalarFieldContainer[str]
    latency_target_ms: float
    cost_priority: str
    latency_weight: float
    cost_weight: float
    queue_threshold: int
    queue_on_saturation: bool
    max_queue_ms: int
    def __init__(self, name: _Optional[str] = ..., strategy: _Optional[str] = ..., accelerator_chain: _Optional[_Iterable[str]] = ..., latency_target_ms: _Optional[float] = ..., cost_priority: _Optional[str] = ..., latency_weight: _Optional[float] = ..., cost_weight: _Optional[float] = ..., queue_threshold: _Optional[int] = ..., queue_on_saturation: _Optional[bool] = ..., max_queue_ms: _Optional[int] = ...) -> None: ...

class InferReply(_message.Message):
    __slots__ = ("id", "model", "choices", "usage", "routing", "json")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    usage: Usage
    routing: Routing
    json: bytes
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., json: _Optional[bytes] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("index", "text", "role", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    role: str
    finish_reason: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., role: _Optional[str] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class InferChunk(_message.Message):
    __slots__ = ("text", "index", "finish_reason", "usage", "json")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    text: str
    index: int
    finish_reason: str
    usage: Usage
    json: bytes
    def __init__(self, text: _Optional[str] = ..., index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., json: _Optional[bytes] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("node_id", "accelerator_type", "family", "policy", "queue_depth_at_dispatch", "decision_id", "request_id", "attempts", "router_id", "time_to_first_token", "total_tokens", "label", "cached_tokens_estimated", "cached_tokens", "continued_from", "priority", "priority_lowered_from", "share_used", "queued_ms", "ttft_slo_ms", "tpot_slo_ms", "predicted_ttft_ms", "predicted_tpot_ms", "tpot_ms", "slo", "prefill_node", "prefill_ms", "prefill_failed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_AT_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FROM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LOWERED_FROM_FIELD_NUMBER: _ClassVar[int]
    SHARE_USED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FAILED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    accelerator_type: str
    family: str
    policy: str
    queue_depth_at_dispatch: int
    decision_id: str
    request_id: str
    attempts: int
    router_id: str
    time_to_first_token: float
    total_tokens: int
    label: str
    cached_tokens_estimated: int
    cached_tokens: int
    continued_from: str
    priority: str
    priority_lowered_from: str
    share_used: float
    queued_ms: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    tpot_ms: float
    slo: str
    prefill_node: str
    prefill_ms: float
    prefill_failed: str
    def __init__(self, node_id: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., family: _Optional[str] = ..., policy: _Optional[str] = ..., queue_depth_at_dispatch: _Optional[int] = ..., decision_id: _Optional[str] = ..., request_id: _Optional[str] = ..., attempts: _Optional[int] = ..., router_id: _Optional[str] = ..., time_to_first_token: _Optional[float] = ..., total_tokens: _Optional[int] = ..., label: _Optional[str] = ..., cached_tokens_estimated: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., continued_from: _Optional[str] = ..., priority: _Optional[str] = ..., priority_lowered_from: _Optional[str] = ..., share_used: _Optional[float] = ..., queued_ms: _Optional[int] = ..., ttft_slo_ms: _Optional[float] = ..., tpot_slo_ms: _Optional[float] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., slo: _Optional[str] = ..., prefill_node: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., prefill_failed: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models", "json")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    json: bytes
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ..., json: _Optional[bytes] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "nodes_up")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODES_UP_FIELD_NUMBER: _ClassVar[int]
    id: str
    nodes_up: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., nodes_up: _Optional[_Iterable[str]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes", "json")
    NODES_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    json: bytes
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., json: _Optional[bytes] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "accelerator_type", "family", "status", "models", "in_flight", "cost_per_hour")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_TYPE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    COST_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    accelerator_type: str
    family: str
    status: str
    models: _containers.RepeatedScalarFieldContainer[str]
    in_flight: int
    cost_per_hour: float
    def __init__(self, node_id: _Optional[str] = ..., accelerator_type: _Optional[str] = ..., family: _Optional[str] = ..., status: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., in_flight: _Optional[int] = ..., cost_per_hour: _Optional[float] = ...) -> None: ...
