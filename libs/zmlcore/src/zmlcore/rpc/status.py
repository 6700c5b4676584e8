"""ZML error codes <-> gRPC status codes, and the metadata that carries ZML's side (pure).

Every code of the error tree maps to one gRPC status (:data:`GRPC_STATUS`, a test keeps it
total); the ZML code itself travels beside it in the trailing metadata (``zml-code``), with the
whole error body (``zml-error-bin``) and Retry-After (``zml-retry-after``). Routing metadata
keeps the HTTP headers' names without ``x-`` (:data:`ROUTING_METADATA`).

    status_for("QUEUE_FULL")                     # grpc.StatusCode.UNAVAILABLE
    code_for_status(grpc.StatusCode.UNAVAILABLE)  # "CONNECTION_FAILED" (no zml-code: unreachable)
"""

from __future__ import annotations

import grpc

from zmlcore.errors import error_class
from zmlcore.messages import ROUTING_HEADER_WORDS

__all__ = ["GRPC_STATUS", "MD_CODE", "MD_ERROR", "MD_RETRY_AFTER", "ROUTING_METADATA", "code_for_status",
           "error_metadata", "status_for"]

#: Trailing metadata of an error: the ZML code, the whole ErrorBody JSON (routing_context...),
#: and Retry-After in seconds.
MD_CODE = "zml-code"
MD_ERROR = "zml-error-bin"
MD_RETRY_AFTER = "zml-retry-after"
#: HTTP header -> gRPC metadata key of the routing metadata (trailing; initial too for streams):
#: ``x-zml-<word>`` -> ``zml-<word>`` for every RoutingInfo field.
ROUTING_METADATA = {f"x-zml-{word.lower()}": f"zml-{word.lower()}" for word in ROUTING_HEADER_WORDS.values()}

_S = grpc.StatusCode
#: ZML code -> gRPC status. Retryable codes are UNAVAILABLE (what gRPC retry policies retry),
#: except RATE_LIMITED (RESOURCE_EXHAUSTED, gRPC's "quota") and TIMEOUT (DEADLINE_EXCEEDED).
GRPC_STATUS: dict[str, grpc.StatusCode] = {
    "INTERNAL": _S.INTERNAL,
    "BAD_REQUEST": _S.INVALID_ARGUMENT,
    "NOT_FOUND": _S.NOT_FOUND,
    "METHOD_NOT_ALLOWED": _S.UNIMPLEMENTED,
    "REQUEST_TOO_LARGE": _S.RESOURCE_EXHAUSTED,
    "HEADERS_TOO_LARGE": _S.RESOURCE_EXHAUSTED,
    "DUPLICATE_REQUEST_ID": _S.ALREADY_EXISTS,
    "REPLY_TOO_LARGE": _S.RESOURCE_EXHAUSTED,
    "INVALID_FILE": _S.INVALID_ARGUMENT,
    "BATCH_STATE": _S.FAILED_PRECONDITION,
    "QUOTA_EXCEEDED": _S.RESOURCE_EXHAUSTED,
    "STORAGE_FULL": _S.RESOURCE_EXHAUSTED,
    "CONFIG_INVALID": _S.INTERNAL,
    "POLICY_CONFIG": _S.INVALID_ARGUMENT,
    "AUTH_FAILED": _S.UNAUTHENTICATED,
    "MODEL_NOT_ALLOWED": _S.PERMISSION_DENIED,
    "RATE_LIMITED": _S.RESOURCE_EXHAUSTED,
    "TIMEOUT": _S.DEADLINE_EXCEEDED,
    "CANCELLED": _S.CANCELLED,
    "BACKEND_ERROR": _S.UNAVAILABLE,
    "STREAM_INTERRUPTED": _S.UNAVAILABLE,
    "REPLY_INCOMPLETE": _S.UNAVAILABLE,
    "UPLOAD_INCOMPLETE": _S.UNAVAILABLE,
    "CONNECTION_FAILED": _S.UNAVAILABLE,
    "ROUTING_FAILED": _S.UNAVAILABLE,
    "NO_HEALTHY_NODES": _S.UNAVAILABLE,
    "MODEL_NOT_LOADED": _S.NOT_FOUND,
    "QUEUE_FULL": _S.UNAVAILABLE,
    "SLO_UNATTAINABLE": _S.UNAVAILABLE,
    "SHED": _S.UNAVAILABLE,
}

#: gRPC status without a ``zml-code`` (the client's own deadline, an unreachable server, a
#: message over a size limit) -> the ZML code it means.
_CODE_OF_STATUS = {
    _S.DEADLINE_EXCEEDED: "TIMEOUT",
    _S.UNAVAILABLE: "CONNECTION_FAILED",
    _S.UNAUTHENTICATED: "AUTH_FAILED",
    _S.PERMISSION_DENIED: "MODEL_NOT_ALLOWED",
    _S.RESOURCE_EXHAUSTED: "REQUEST_TOO_LARGE",
    _S.INVALID_ARGUMENT: "BAD_REQUEST",
    _S.CANCELLED: "CANCELLED",
    _S.NOT_FOUND: "MODEL_NOT_LOADED",
    _S.ALREADY_EXISTS: "DUPLICATE_REQUEST_ID",
}


def status_for(code: str) -> grpc.StatusCode:
    """The gRPC status of a ZML code (an unknown code: that of its HTTP status class)."""
    found = GRPC_STATUS.get(code)
    if found is not None:
        return found
    status = error_class(code).http_status
    return _S.INVALID_ARGUMENT if 400 <= status < 500 else _S.UNKNOWN


def code_for_status(status: grpc.StatusCode) -> str:
    """The ZML code of a gRPC status that came without ``zml-code``."""
    return _CODE_OF_STATUS.get(status, "BACKEND_ERROR")


def error_metadata(exc_body: bytes, code: str, retry_after: float | None) -> list[tuple[str, str | bytes]]:
    """Trailing metadata of an error reply (``exc_body``: the ErrorBody JSON)."""
    md: list[tuple[str, str | bytes]] = [(MD_CODE, code), (MD_ERROR, exc_body)]
    if retry_after is not None:
        md.append((MD_RETRY_AFTER, f"{retry_after:g}"))
    return md
