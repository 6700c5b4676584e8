"""ZML's one error tree. Every error has a stable ``code`` that crosses every boundary.

::

    ZMLError                      INTERNAL            500
    ├── BadRequestError           BAD_REQUEST         400
    │   ├── NotFoundError         NOT_FOUND           404  (unknown HTTP path, file or batch)
    │   ├── MethodNotAllowedError METHOD_NOT_ALLOWED  405
    │   ├── RequestTooLargeError  REQUEST_TOO_LARGE   413
    │   ├── HeadersTooLargeError  HEADERS_TOO_LARGE   431
    │   ├── DuplicateRequestError DUPLICATE_REQUEST_ID 409 (the owner has this request id in flight)
    │   ├── ReplyTooLargeError    REPLY_TOO_LARGE     400  (over max_payload and not collected in parts)
    │   ├── InvalidFileError      INVALID_FILE        400  (a batch input file with bad lines)
    │   └── BatchStateError       BATCH_STATE         409  (not possible in the batch's status)
    ├── ConfigError               CONFIG_INVALID      (start-up only)
    │   └── PolicyConfigError     POLICY_CONFIG       400
    ├── AuthError                 AUTH_FAILED         401
    │   └── PermissionDeniedError MODEL_NOT_ALLOWED   403  (the key may not use this model)
    ├── RateLimitError            RATE_LIMITED        429  retryable
    ├── QuotaExceededError        QUOTA_EXCEEDED      429  (too many files or batches for this key)
    ├── StorageFullError          STORAGE_FULL        507  retryable (the batch store is full)
    ├── TimeoutError              TIMEOUT             504  retryable
    ├── CancelledError            CANCELLED           499
    ├── BackendError              BACKEND_ERROR       502  retryable
    │   ├── StreamInterruptedError STREAM_INTERRUPTED 502  retryable (a relayed stream lost a message)
    │   └── ReplyIncompleteError  REPLY_INCOMPLETE    502  retryable (a reply in parts lost a part)
    ├── ConnectionError           CONNECTION_FAILED   503  retryable (client side: endpoint unreachable)
    └── RoutingError              (routing_context attached)
        ├── NoHealthyNodesError   NO_HEALTHY_NODES    503  retryable
        ├── ModelNotLoadedError   MODEL_NOT_LOADED    404
        ├── QueueFullError        QUEUE_FULL          503  retryable
        ├── SloUnattainableError  SLO_UNATTAINABLE    503  retryable (no node meets the request's TTFT/TPOT target), unless without retry_after (none ever would)
        └── ShedError             SHED                503  retryable (queued work dropped for higher bands)

On NATS an error reply carries the header ``Zml-Error-Code`` and an :class:`ErrorBody` JSON
payload; over HTTP the same body (OpenAI's error shape plus our code) with the status above.
:func:`from_wire` maps a code back to its class; it is the only such mapping.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

__all__ = [
    "AuthError",
    "BackendError",
    "BadRequestError",
    "BatchStateError",
    "CancelledError",
    "ConfigError",
    "ConnectionError",
    "DuplicateRequestError",
    "ErrorBody",
    "ErrorDetail",
    "HeadersTooLargeError",
    "InvalidFileError",
    "MethodNotAllowedError",
    "ModelNotLoadedError",
    "NotFoundError",
    "PermissionDeniedError",
    "RequestTooLargeError",
    "NoHealthyNodesError",
    "PolicyConfigError",
    "QueueFullError",
    "QuotaExceededError",
    "RateLimitError",
    "ReplyIncompleteError",
    "ReplyTooLargeError",
    "RoutingError",
    "ShedError",
    "SloUnattainableError",
    "StorageFullError",
    "StreamInterruptedError",
    "TimeoutError",
    "UploadIncompleteError",
    "ZMLError",
    "error_class",
    "from_wire",
]


class ZMLError(Exception):
    """Base of every ZML error. ``code`` is stable; ``message`` says what to do."""

    code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False
    #: OpenAI's ``error.type`` for the same situation, so OpenAI clients classify it sensibly.
    openai_type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str = "",
        *,
        routing_context: dict[str, Any] | None = None,
        retry_after: float | None = None,
        param: str | None = None,
    ) -> None:
        self.message = message or self.__class__.__doc__ or self.code
        self.routing_context = routing_context
        self.retry_after = retry_after
        #: OpenAI's ``error.param``: the parameter (or place, e.g. "line 3") at fault.
        self.param = param
        super().__init__(self.message)

    @classmethod
    def worth_retrying(cls, retry_after: float | None) -> bool:
        """Whether the same request may succeed later, given the error's ``retry_after``: the
        class's ``retryable``, unless the error says no later time exists."""
        return cls.retryable

    def __str__(self) -> str:
        text = f"[{self.code}] {self.message}"
        if self.routing_context:
            text += f" routing_context={msgspec.json.encode(self.routing_context).decode()}"
        return text

    def to_body(self) -> ErrorBody:
        return ErrorBody(
            error=ErrorDetail(
                message=self.message,
                type=self.openai_type,
                code=self.code,
                param=self.param,
                routing_context=self.routing_context,
                retry_after=self.retry_after,
            )
        )


class BadRequestError(ZMLError):
    """The request is malformed: fix it before retrying."""

    code = "BAD_REQUEST"
    http_status = 400
    openai_type = "invalid_request_error"


class NotFoundError(BadRequestError):
    """No such path on this server."""

    code = "NOT_FOUND"
    http_status = 404


class MethodNotAllowedError(BadRequestError):
    """The path exists but not with this HTTP method."""

    code = "METHOD_NOT_ALLOWED"
    http_status = 405


class RequestTooLargeError(BadRequestError):
    """The request body is larger than this deployment accepts (``[gateway] max_body_bytes``;
    audio: ``[defaults] max_audio_bytes``). A body larger than one NATS message is not refused
    for it: it goes to its router in parts."""

    code = "REQUEST_TOO_LARGE"
    http_status = 413


class HeadersTooLargeError(BadRequestError):
    """Too many request headers, or too large."""

    code = "HEADERS_TOO_LARGE"
    http_status = 431


class DuplicateRequestError(BadRequestError):
    """The caller already has a request with this ``request_id`` in flight: wait for it, cancel
    it, or use a new id (ids are scoped to their owner, so another caller's ids never clash)."""

    code = "DUPLICATE_REQUEST_ID"
    http_status = 409


class ReplyTooLargeError(BadRequestError):
    """The reply is (or could be) larger than one NATS message and the requester does not
    collect replies in parts: send the request with the header ``Zml-Accept-Parts: <bytes>``
    (docs/security.md), or ask for less (``max_tokens``, ``n``, fewer inputs). Also the answer
    when a reply is over the requester's own ``Zml-Accept-Parts`` limit."""

    code = "REPLY_TOO_LARGE"
    http_status = 400


class InvalidFileError(BadRequestError):
    """A batch input file has lines that cannot run (not JSON, a repeated ``custom_id``, an
    unknown model or endpoint...): the message names the first few by line number."""

    code = "INVALID_FILE"
    http_status = 400


class BatchStateError(BadRequestError):
    """The batch's status does not allow this (e.g. cancelling a completed batch)."""

    code = "BATCH_STATE"
    http_status = 409


class ConfigError(ZMLError):
    """zml.toml (or another configuration source) is invalid."""

    code = "CONFIG_INVALID"
    http_status = 500
    openai_type = "server_error"


class PolicyConfigError(ConfigError):
    """A routing policy is invalid (unknown family or strategy, bad weights...)."""

    code = "POLICY_CONFIG"
    http_status = 400
    openai_type = "invalid_request_error"


class AuthError(ZMLError):
    """Invalid or missing API key. Check the ZML_API_KEY environment variable."""

    code = "AUTH_FAILED"
    http_status = 401
    openai_type = "authentication_error"


class PermissionDeniedError(AuthError):
    """This API key may not use the requested model."""

    code = "MODEL_NOT_ALLOWED"
    http_status = 403
    openai_type = "permission_error"


class RateLimitError(ZMLError):
    """Too many requests for this key: back off and retry."""

    code = "RATE_LIMITED"
    http_status = 429
    retryable = True
    openai_type = "rate_limit_error"


class QuotaExceededError(ZMLError):
    """This key holds as many files or unfinished batches as the deployment allows
    (``[batch]`` limits): delete files, or wait for batches to finish."""

    code = "QUOTA_EXCEEDED"
    http_status = 429
    openai_type = "rate_limit_error"


class StorageFullError(ZMLError):
    """The batch store is at its size bound (``[batch] max_store_bytes``): retry later."""

    code = "STORAGE_FULL"
    http_status = 507
    retryable = True
    openai_type = "server_error"


class TimeoutError(ZMLError):  # noqa: A001 - the seeds name the code TIMEOUT; shadowing is scoped
    """The request exceeded its timeout. Increase the timeout or reduce prompt length."""

    code = "TIMEOUT"
    http_status = 504
    retryable = True
    openai_type = "timeout_error"


class CancelledError(ZMLError):
    """The request was cancelled by its caller."""

    code = "CANCELLED"
    http_status = 499
    openai_type = "cancelled"


class BackendError(ZMLError):
    """The accelerator node failed and no other node could take the request."""

    code = "BACKEND_ERROR"
    http_status = 502
    retryable = True
    openai_type = "server_error"


class StreamInterruptedError(BackendError):
    """A streamed reply lost a message on its way (core NATS is at-most-once, e.g. across a
    broker restart): the stream ends with this error rather than with silently missing text."""

    code = "STREAM_INTERRUPTED"
    http_status = 502
    retryable = True
    openai_type = "server_error"


class ReplyIncompleteError(BackendError):
    """A reply sent in parts (it was larger than one NATS message) lost a part on its way
    (core NATS is at-most-once): the request fails with this error rather than with a
    truncated body. Retrying runs it again."""

    code = "REPLY_INCOMPLETE"
    http_status = 502
    retryable = True
    openai_type = "server_error"


class UploadIncompleteError(ReplyIncompleteError):
    """A request uploaded in parts (larger than one NATS message: audio) lost a part on its way
    to the router, or its requester stopped sending: nothing ran. Retrying sends it again."""

    code = "UPLOAD_INCOMPLETE"
    http_status = 502
    retryable = True
    openai_type = "server_error"


class ConnectionError(ZMLError):  # noqa: A001 - scoped like TimeoutError
    """The ZML endpoint could not be reached. Is `zml up` running? Check ZML_ENDPOINT."""

    code = "CONNECTION_FAILED"
    http_status = 503
    retryable = True
    openai_type = "api_connection_error"


class RoutingError(ZMLError):
    """No node could be chosen; ``routing_context`` says what was evaluated and why."""

    code = "ROUTING_FAILED"
    http_status = 503
    retryable = True
    openai_type = "server_error"


class NoHealthyNodesError(RoutingError):
    """All nodes for this model failed health checks. Check connectivity and driver status."""

    code = "NO_HEALTHY_NODES"
    http_status = 503
    retryable = True


class ModelNotLoadedError(RoutingError):
    """The model is not loaded on any available node. Run `zml serve MODEL` first."""

    code = "MODEL_NOT_LOADED"
    http_status = 404
    retryable = False
    openai_type = "invalid_request_error"


class QueueFullError(RoutingError):
    """All nodes for this model are over their queue threshold. Retry with backoff or scale out."""

    code = "QUEUE_FULL"
    http_status = 503
    retryable = True


class SloUnattainableError(RoutingError):
    """No node can meet the request's latency target (``x-zml-ttft-slo-ms`` /
    ``x-zml-tpot-slo-ms``) now: refused at once rather than sent to arrive late.
    ``retry_after`` says when the fleet is expected to meet it again (absent: no node ever would)."""

    code = "SLO_UNATTAINABLE"
    http_status = 503
    retryable = True

    @classmethod
    def worth_retrying(cls, retry_after: float | None) -> bool:
        # Without a Retry-After not even an idle fleet meets the target: asking again only waits.
        return retry_after is not None


class ShedError(RoutingError):
    """Dropped from the saturation queue: higher-band work took the capacity it waited for, or it
    could no longer start within its latency target. Retry after ``retry_after``."""

    code = "SHED"
    http_status = 503
    retryable = True


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """OpenAI's ``error`` object plus ZML's fields. ``type`` and ``code`` default to "" so that
    ``omit_defaults`` never drops a real value (it dropped ``"server_error"`` from every 5xx);
    a peer that sent neither decodes as ``server_error``/``INTERNAL``."""

    message: str
    type: str = ""
    code: str = ""
    param: str | None = None
    routing_context: dict[str, Any] | None = None
    retry_after: float | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """The one wire form of an error, over NATS and HTTP alike: ``{"error": {...}}``."""

    error: ErrorDetail


def _all_subclasses(cls: type[ZMLError]) -> list[type[ZMLError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[ZMLError]] = {c.code: c for c in _all_subclasses(ZMLError)}


def error_class(code: str) -> type[ZMLError]:
    """The class for a wire code; unknown codes map to :class:`ZMLError` (keeps the code)."""
    return _BY_CODE.get(code, ZMLError)


def from_wire(detail: ErrorDetail) -> ZMLError:
    """Rebuild the exception a peer sent. Unknown codes keep their code on a ZMLError."""
    cls = error_class(detail.code or ZMLError.code)
    exc = cls(detail.message, routing_context=detail.routing_context, retry_after=detail.retry_after,
              param=detail.param)
    if cls is ZMLError and detail.code and detail.code != ZMLError.code:
        exc.code = detail.code  # type: ignore[misc]  # instance attribute shadows the ClassVar
    return exc
