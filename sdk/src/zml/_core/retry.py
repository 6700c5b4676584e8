"""Failures and retries, sans-I/O: what a timeout or an unanswered NATS subject means as a
ZMLError, whether an error is worth another attempt and how long to wait first (time and
randomness come from the caller)."""

from __future__ import annotations

from zml._errors import TimeoutError, ZMLError, error_class
from zmlcore import subjects

__all__ = ["MAX_BACKOFF_S", "MAX_JITTER_S", "is_retryable", "no_router_error", "retry_delay", "timeout_error"]

#: Backoff ceiling and Retry-After cap (seconds).
MAX_BACKOFF_S = 60.0
MAX_JITTER_S = 0.5


def is_retryable(exc: BaseException) -> bool:
    """Transient: 429, 503 (QUEUE_FULL, NO_HEALTHY_NODES), 5xx, network, timeout; not an SLO that
    no node would meet even idle (SLO_UNATTAINABLE without a Retry-After)."""
    return isinstance(exc, ZMLError) and exc.worth_retrying(exc.retry_after)


def retry_delay(exc: BaseException, retries_done: int, max_retries: int, jitter: float) -> float | None:
    """Seconds to wait before the next attempt, or None to give up and raise ``exc``.

    ``min(2**retries_done, 60)`` plus ``jitter`` (0..1, scaled to at most 0.5 s); a
    ``Retry-After`` from the server replaces it (capped at 60 s).
    """
    if retries_done >= max_retries or not is_retryable(exc):
        return None
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        return min(max(0.0, float(retry_after)), MAX_BACKOFF_S)
    return min(2.0**retries_done, MAX_BACKOFF_S) + max(0.0, min(1.0, jitter)) * MAX_JITTER_S


def timeout_error(timeout_s: float, request_id: str) -> ZMLError:
    return TimeoutError(
        f"no reply within {timeout_s:.1f}s (request {request_id}). Increase timeout or reduce prompt length."
    )


def no_router_error(subject: str = subjects.INFER) -> ZMLError:
    """What a NATS "no responders" status means: nothing serves ``subject``."""
    who = "ZML router" if subject == subjects.INFER else "ZML service"
    return error_class("NO_HEALTHY_NODES")(
        f"no {who} answers on NATS subject {subject!r}: start ZML with `zml up` or check the nats:// endpoint",
        retry_after=1.0,
    )

