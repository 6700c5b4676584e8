"""The OpenAI JSON of the Batch API, made from stored records (pure).

Shapes as OpenAI documents them (and the ``openai`` package parses them): the file object,
the batch object with ``request_counts`` and ``usage``, list pages (``data``, ``first_id``,
``last_id``, ``has_more``, paged with ``after``), and the lines of output and error files::

    {"id": "batch_req_...", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "...", "body": {...chat.completion..., "zml": {...}}},
     "error": null}
    {"id": "batch_req_...", "custom_id": "r2", "response": null,
     "error": {"code": "batch_expired", "message": "..."}}

A line the model answered with an error keeps OpenAI's form too: ``response`` with its 4xx/5xx
``status_code`` and the error body, in the error file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from zmlcore.batch.ids import output_line_id
from zmlcore.messages.batch import BatchEvent, BatchRecord, FileRecord, LineResult

_encode = msgspec.json.encode

#: Why a line has no answer, by the status its batch ended in.
UNANSWERED: dict[str, tuple[str, str]] = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was cancelled."),
    "completed": ("batch_failed", "This request could not be executed."),
}


def file_object(rec: FileRecord) -> dict[str, Any]:
    return {"id": rec.id, "object": "file", "bytes": rec.bytes, "created_at": rec.created_at,
            "filename": rec.filename, "purpose": rec.purpose, "status": "processed",
            "expires_at": rec.expires_at, "status_details": None}


def deleted_file(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


@dataclass(frozen=True, slots=True)
class Counts:
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def counts(rec: BatchRecord) -> Counts:
    """The batch's line counts and tokens: the sum of its shards' entries."""
    ok = failed = prompt = completion = 0
    for entry in rec.progress.values():
        ok += entry[0]
        failed += entry[1]
        if len(entry) >= 4:
            prompt += entry[2]
            completion += entry[3]
    return Counts(ok, failed, prompt, completion)


def batch_object(rec: BatchRecord) -> dict[str, Any]:
    c = counts(rec)
    errors = None
    if rec.errors:
        errors = {"object": "list", "data": [msgspec.to_builtins(e) for e in rec.errors]}
    return {
        "id": rec.id, "object": "batch", "endpoint": rec.endpoint, "errors": errors,
        "input_file_id": rec.input_file_id, "completion_window": rec.completion_window, "status": rec.status,
        "output_file_id": rec.output_file_id, "error_file_id": rec.error_file_id, "created_at": rec.created_at,
        "in_progress_at": rec.in_progress_at, "expires_at": rec.expires_at, "finalizing_at": rec.finalizing_at,
        "completed_at": rec.completed_at, "failed_at": rec.failed_at, "expired_at": rec.expired_at,
        "cancelling_at": rec.cancelling_at, "cancelled_at": rec.cancelled_at,
        "request_counts": {"total": rec.total, "completed": c.completed, "failed": c.failed},
        "usage": {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": c.prompt_tokens + c.completion_tokens},
        "metadata": rec.metadata, "model": rec.model or None,
    }


def page(ids: Sequence[str], after: str | None, limit: int, *, newest_first: bool = True) -> tuple[list[str], bool]:
    """One page of ``ids`` (ids sort by creation time): those after ``after`` in that order,
    at most ``limit``, and whether more follow. An ``after`` that is not in the list starts
    where it would sort."""
    ordered = sorted(ids, reverse=newest_first)
    start = 0
    if after:
        start = next((i for i, x in enumerate(ordered) if (x < after if newest_first else x > after)), len(ordered))
    chosen = ordered[start:start + limit]
    return chosen, start + limit < len(ordered)


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def output_line(batch_id: str, result: LineResult) -> tuple[bool, bytes]:
    """(goes to the output file?, the line with its newline) for one line's result."""
    lid = output_line_id(batch_id, result.line)
    if result.status_code:
        body = bytes(result.body) or b"null"
        line = (b'{"id":' + _encode(lid) + b',"custom_id":' + _encode(result.custom_id)
                + b',"response":{"status_code":' + str(result.status_code).encode()
                + b',"request_id":' + _encode(result.request_id) + b',"body":' + body + b'},"error":null}\n')
        return result.status_code == 200, line
    return False, unanswered_line(batch_id, result.line, result.custom_id, result.error_code, result.error_message)


def unanswered_line(batch_id: str, line: int, custom_id: str, code: str, message: str) -> bytes:
    return _encode({"id": output_line_id(batch_id, line), "custom_id": custom_id, "response": None,
                    "error": {"code": code, "message": message}}) + b"\n"


def event(rec: BatchRecord, now: float) -> BatchEvent:
    """What ``zml.batch.events`` says of a batch now."""
    c = counts(rec)
    return BatchEvent(batch_id=rec.id, status=rec.status, total=rec.total, completed=c.completed, failed=c.failed,
                      ts=now)
