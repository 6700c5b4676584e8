"""The SDK's errors: zmlcore's one error tree, re-exported, plus the network boundary.

::

    ZMLError (.code, .message, .routing_context, .retry_after, .retryable)
    ├── BadRequestError, AuthError, RateLimitError, TimeoutError, CancelledError, BackendError
    │   (BackendError -> StreamInterruptedError: a streamed reply lost a message in transit;
    │    BackendError -> ReplyIncompleteError: a reply over max_payload lost one of its parts;
    │    ReplyIncompleteError -> UploadIncompleteError: an audio body sent in parts lost one;
    │    BadRequestError -> ReplyTooLargeError: a reply over [nats] max_reply_bytes)
    ├── ConnectionError      CONNECTION_FAILED  (the endpoint could not be reached)
    ├── ConfigError -> PolicyConfigError
    └── RoutingError -> NoHealthyNodesError, ModelNotLoadedError, QueueFullError,
                        SloUnattainableError (SLO_UNATTAINABLE), ShedError (SHED)

Wire codes map back to classes in :func:`zmlcore.errors.from_wire`, the only such mapping.
"""

from __future__ import annotations

from zmlcore.errors import (
    AuthError,
    BackendError,
    BadRequestError,
    CancelledError,
    ConfigError,
    ConnectionError,
    ErrorBody,
    ErrorDetail,
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
    error_class,
    from_wire,
)

__all__ = [
    "AuthError",
    "BackendError",
    "BadRequestError",
    "CancelledError",
    "ConfigError",
    "ConnectionError",
    "ErrorBody",
    "ErrorDetail",
    "ModelNotLoadedError",
    "NoHealthyNodesError",
    "PolicyConfigError",
    "QueueFullError",
    "RateLimitError",
    "ReplyIncompleteError",
    "ReplyTooLargeError",
    "RoutingError",
    "ShedError",
    "SloUnattainableError",
    "StreamInterruptedError",
    "TimeoutError",
    "UploadIncompleteError",
    "ZMLError",
    "error_class",
    "from_wire",
]


