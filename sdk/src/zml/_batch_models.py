"""Public types of the Batch API (``client.batches``, ``client.files``): OpenAI's batch and
file objects, as plain dataclasses.

Example::

    batch = client.batches.retrieve("batch_...")
    print(batch.status, batch.request_counts.completed, "/", batch.request_counts.total)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["Batch", "BatchFile", "BatchPage", "RequestCounts"]

#: Statuses after which a batch does not change any more.
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


@dataclass(slots=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(slots=True)
class Batch:
    """A batch as the gateway last reported it (OpenAI's batch object, ``raw`` in full)."""

    id: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    request_counts: RequestCounts
    output_file_id: str | None = None
    error_file_id: str | None = None
    expires_at: int | None = None
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """The batch has ended (completed, failed, expired or cancelled)."""
        return self.status in TERMINAL


@dataclass(slots=True)
class BatchFile:
    """A stored file (an uploaded input, or a batch's output or error file)."""

    id: str
    filename: str
    bytes: int
    created_at: int
    purpose: str
    expires_at: int | None = None


T = TypeVar("T")


@dataclass(slots=True)
class BatchPage(Generic[T]):
    """One page of a list; pass ``last_id`` as ``after`` for the next while ``has_more``."""

    data: list[T]
    has_more: bool
    last_id: str | None
