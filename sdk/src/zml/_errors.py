"""The SDK's errors: zmlcore's one error tree, re-exported, plus the network boundary.

::

    ZMLError (.code, .message, .routing_context, .retry_after, .retryable)
    ├── BadRequestError, AuthError, RateLimitError, TimeoutError, CancelledError, BackendError
    ├── ConfigError -> PolicyConfigError
    ├── RoutingError -> NoHealthyNodesError, ModelNotLoadedError, QueueFullError
    └── ConnectionError      CONNECTION_FAILED  (SDK only: the endpoint could not be reached)

Wire codes map back to classes in :func:`zmlcore.errors.from_wire`, the only such mapping.
"""

from __future__ import annotations

from zmlcore.errors import (
    AuthError,
    BackendError,
    BadRequestError,
    CancelledError,
    ConfigError,
    ErrorBody,
    ErrorDetail,
    ModelNotLoadedError,
    NoHealthyNodesError,
    PolicyConfigError,
    QueueFullError,
    RateLimitError,
    RoutingError,
    TimeoutError,
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
    "RoutingError",
    "TimeoutError",
    "ZMLError",
    "error_class",
    "from_wire",
]


class ConnectionError(ZMLError):  # noqa: A001 - scoped like zmlcore's TimeoutError
    """The ZML endpoint could not be reached. Is `zml up` running? Check ZML_ENDPOINT."""

    code = "CONNECTION_FAILED"
    http_status = 503
    retryable = True
    openai_type = "api_connection_error"
