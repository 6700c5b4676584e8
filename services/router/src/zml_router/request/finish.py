"""How a request ends (step 4 of zml_router.request): the errors of a passed deadline, how a
failed attempt marks its node, the event of a finished request."""

from __future__ import annotations

from zmlcore.errors import (
    QueueFullError,
    TimeoutError,
)
from zmlcore.messages.warmup import RequestCompleted

from zml_router.node.attempt import AttemptError, Failure
from zml_router.outcome import Outcome
from zml_router.request.route import NODE_FAULTS


def deadline_passed(timeout_s: float) -> TimeoutError:
    """The request's own deadline passed while it was being routed or served."""
    return TimeoutError(f"request exceeded its timeout of {timeout_s:g} s")


def queue_expired(waited_ms: int) -> QueueFullError:
    """A queued request whose deadline passed before any node had room."""
    return QueueFullError(
        f"no node had room within max_queue_ms (waited {waited_ms} ms)",
        routing_context={"final_error": "queue_timeout", "waited_ms": waited_ms,
                         "recommendation": "increase fleet capacity or max_queue_ms"},
        retry_after=1.0,
    )


def penalty(err: AttemptError, saturated_s: float, cooldown_s: float) -> tuple[str, float] | None:
    """How a failed attempt marks its node: (kind, seconds), or None for no mark."""
    if err.failure is Failure.OVERLOADED:
        # "Retry-After: 0" from an overloaded node would mean "hammer me": use the default.
        return "saturated", err.retry_after or saturated_s
    if err.failure in NODE_FAULTS:
        return "cooldown", err.retry_after if err.retry_after is not None else cooldown_s
    return None


def completion(out: Outcome, now: float, latency_s: float, router_id: str) -> RequestCompleted:
    """The event of a finished request (warmup measures demand, health counts node errors).
    A request that failed on its last node blames that node as ``node_id``; the others it
    failed on before are ``failed_nodes``."""
    info = out.info
    node_error = not out.ok and out.node_error
    failed = out.failed_nodes[:-1] if node_error else out.failed_nodes
    return RequestCompleted(
        model=out.model, node_id=out.node_id, family=out.family, ok=out.ok, error_code=out.error_code,
        node_error=node_error, failed_nodes=failed, ts=now,
        ttft_s=info.time_to_first_token if info is not None and out.ok else None,
        latency_s=latency_s, attempts=out.attempts, router_id=router_id,
        request_id=out.request_id, slow_nodes=out.slow_nodes, label=out.label,
        prompt_tokens=out.prompt_tokens if out.ok else 0, completion_tokens=out.completion_tokens if out.ok else 0,
        speed=out.sample if out.ok else None,
    )
