"""ZML Python SDK: route LLM inference across accelerator fleets.

Example::

    import zml

    client = zml.Client()   # endpoint: argument, ZML_ENDPOINT, zml.toml, or http://127.0.0.1:8080
    result = client.infer("meta-llama/llama-3-8b-instruct", "Hello", max_tokens=32)
    print(result.text, result.metadata.accelerator_id, result.routing.family)

``zml.AsyncClient`` is the asyncio twin. Endpoints: ``http(s)://`` (the gateway) or
``nats://`` (straight to the routers). Every failure is a :class:`zml.ZMLError` with a stable
``code``.
"""

from zml import _client, _fleet
from zml._async_client import AsyncClient, AsyncStream
from zml._batch_models import Batch, BatchFile, BatchPage, RequestCounts
from zml._client import Client, Stream
from zml._errors import (
    AuthError,
    BackendError,
    BadRequestError,
    CancelledError,
    ConfigError,
    ConnectionError,
    ModelNotLoadedError,
    NoHealthyNodesError,
    PolicyConfigError,
    QueueFullError,
    RateLimitError,
    ReplyIncompleteError,
    ReplyTooLargeError,
    RoutingError,
    ShedError,
    SloUnattainableError,
    StreamInterruptedError,
    TimeoutError,
    UploadIncompleteError,
    ZMLError,
)
from zml._models import (
    BatchResult,
    Choice,
    EmbeddingResult,
    InferMeta,
    InferResult,
    Message,
    Metrics,
    Policy,
    Routing,
    StreamChunk,
    TranscriptionResult,
    Usage,
)
from zmlcore.messages import NodeState

# Policy(...) checks its families against the fleet's; the fleet is asked through a real client
# (every transport, zml.toml's identity), wired here so that _fleet imports nothing above it.
_fleet.ask_with(_client.fleet_families)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "AuthError",
    "BackendError",
    "BadRequestError",
    "Batch",
    "BatchFile",
    "BatchPage",
    "BatchResult",
    "CancelledError",
    "Choice",
    "Client",
    "ConfigError",
    "ConnectionError",
    "EmbeddingResult",
    "InferMeta",
    "InferResult",
    "Message",
    "Metrics",
    "ModelNotLoadedError",
    "NoHealthyNodesError",
    "NodeState",
    "Policy",
    "PolicyConfigError",
    "QueueFullError",
    "RateLimitError",
    "ReplyIncompleteError",
    "ReplyTooLargeError",
    "RequestCounts",
    "Routing",
    "RoutingError",
    "ShedError",
    "SloUnattainableError",
    "Stream",
    "StreamChunk",
    "StreamInterruptedError",
    "TimeoutError",
    "TranscriptionResult",
    "UploadIncompleteError",
    "Usage",
    "ZMLError",
    "__version__",
]
