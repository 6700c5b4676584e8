"""What a line's attempt means for the line (pure): answer it, or send it again later.

The routers' error codes (docs/nats-api.md) sort into:

* **no room now**: QUEUE_FULL (no headroom for batch work, or the fleet is saturated),
  RATE_LIMITED, NO_HEALTHY_NODES, MODEL_NOT_LOADED (nothing serves the model yet: warmup or
  `zml serve` may load it within the window). The line waits and is sent again; this is not
  a failed attempt (a batch waits for capacity, it does not fail for want of it);
* **busy**: DUPLICATE_REQUEST_ID (an earlier attempt of this very line is still running on a
  router: its id is the line's), CANCELLED (we cancelled it): sent again later, not counted;
* **failed attempt**: BACKEND_ERROR, TIMEOUT, STREAM_INTERRUPTED, REPLY_INCOMPLETE,
  CONNECTION_FAILED, INTERNAL: sent again up to ``[batch] max_attempts``, then answered with
  the last error;
* anything else (BAD_REQUEST, REPLY_TOO_LARGE, MODEL_NOT_ALLOWED, ...): answered at once with
  the error, which no retry would change.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["answer", "refused", "busy", "retry"]

REFUSED = frozenset({"QUEUE_FULL", "RATE_LIMITED", "NO_HEALTHY_NODES", "ROUTING_FAILED", "MODEL_NOT_LOADED"})
BUSY = frozenset({"DUPLICATE_REQUEST_ID", "CANCELLED"})
RETRY = frozenset({"BACKEND_ERROR", "TIMEOUT", "STREAM_INTERRUPTED", "REPLY_INCOMPLETE", "CONNECTION_FAILED",
                   "INTERNAL"})

#: Seconds before a line is sent again, by kind (a router's Retry-After wins when longer).
DELAY_S = {"refused": 0.2, "busy": 5.0, "retry": 2.0}
#: Waiting for a model nobody serves yet: no point asking every fraction of a second.
NOT_LOADED_DELAY_S = 5.0


def classify(code: str | None) -> Kind:
    if code is None:
        return "answer"
    if code in REFUSED:
        return "refused"
    if code in BUSY:
        return "busy"
    if code in RETRY:
        return "retry"
    return "answer"


def retry_delay(kind: Kind, code: str | None, attempt: int, retry_after: float | None) -> float:
    """Seconds before the next attempt: the kind's delay (doubling with failed attempts for
    ``retry``), or the router's Retry-After if longer."""
    base = NOT_LOADED_DELAY_S if code == "MODEL_NOT_LOADED" else DELAY_S.get(kind, 1.0)
    if kind == "retry":
        base = min(60.0, base * 2 ** max(0, attempt - 1))
    return max(base, retry_after or 0.0)
