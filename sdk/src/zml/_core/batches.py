"""The Batch API, sans-I/O: what ``client.batches`` and ``client.files`` send (an
:class:`ApiCall`) and how their replies decode, shared by the sync and async clients.

Also the input file itself: :func:`request_lines` turns the SDK's batch items (a prompt, a
list of messages, or a dict of ``infer()`` arguments, as ``infer_batch`` takes them) into
OpenAI's batch request lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zml._batch_models import Batch, BatchFile, BatchPage, RequestCounts
from zml._core.reply import RawReply, decode_error, int_or
from zml._errors import BackendError, BadRequestError

__all__ = ["ApiCall", "ENDPOINTS", "cancel_batch", "create_batch", "decode_batch", "decode_batches", "decode_file",
           "decode_files", "decode_json", "delete_file", "file_content", "get_batch", "get_file", "list_batches", "list_files",
           "request_lines", "upload_file"]

ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}
#: infer() arguments that are not part of the OpenAI body of a line.
_NOT_BODY = {"id", "custom_id", "timeout", "request_id", "accelerator_id"}


@dataclass(slots=True)
class ApiCall:
    """One Batch API request: JSON ``body``, or a multipart ``upload`` (file name and bytes)
    with form ``fields``; ``raw``: the reply is a file's bytes, not JSON."""

    method: str
    path: str
    body: bytes | None = None
    upload: tuple[str, bytes] | None = None
    fields: dict[str, str] | None = None
    query: dict[str, str] | None = None
    raw: bool = False


def upload_file(filename: str, content: bytes, purpose: str = "batch") -> ApiCall:
    return ApiCall("POST", "/v1/files", upload=(filename, content), fields={"purpose": purpose})


def create_batch(input_file_id: str, endpoint: str, completion_window: str = "24h",
                 metadata: Mapping[str, str] | None = None) -> ApiCall:
    body: dict[str, Any] = {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": completion_window}
    if metadata:
        body["metadata"] = dict(metadata)
    return ApiCall("POST", "/v1/batches", body=json.dumps(body).encode())


def get_batch(batch_id: str) -> ApiCall:
    return ApiCall("GET", f"/v1/batches/{_id(batch_id)}")


def cancel_batch(batch_id: str) -> ApiCall:
    return ApiCall("POST", f"/v1/batches/{_id(batch_id)}/cancel")


def list_batches(after: str | None = None, limit: int = 20) -> ApiCall:
    return ApiCall("GET", "/v1/batches", query=_page(after, limit))


def get_file(file_id: str) -> ApiCall:
    return ApiCall("GET", f"/v1/files/{_id(file_id)}")


def delete_file(file_id: str) -> ApiCall:
    return ApiCall("DELETE", f"/v1/files/{_id(file_id)}")


def file_content(file_id: str) -> ApiCall:
    return ApiCall("GET", f"/v1/files/{_id(file_id)}/content", raw=True)


def list_files(after: str | None = None, limit: int = 100, purpose: str | None = None) -> ApiCall:
    q = _page(after, limit)
    if purpose:
        q["purpose"] = purpose
    return ApiCall("GET", "/v1/files", query=q)


def _id(value: str) -> str:
    if not value or "/" in value or "?" in value:
        raise BadRequestError(f"not an id: {value!r}")
    return value


def _page(after: str | None, limit: int) -> dict[str, str]:
    q = {"limit": str(limit)}
    if after:
        q["after"] = after
    return q


# --- replies -------------------------------------------------------------------------------------
def decode_json(raw: RawReply) -> dict[str, Any]:
    if raw.status >= 400:
        raise decode_error(raw)
    try:
        data = json.loads(raw.body)
    except ValueError:
        raise BackendError(f"HTTP {raw.status}: the reply is not JSON") from None
    if not isinstance(data, dict):
        raise BackendError(f"HTTP {raw.status}: the reply is not a JSON object")
    return data


def batch_of(d: Mapping[str, Any]) -> Batch:
    counts = d.get("request_counts") or {}
    errors = (d.get("errors") or {}).get("data") or []
    return Batch(id=str(d.get("id", "")), status=str(d.get("status", "")), endpoint=str(d.get("endpoint", "")),
                 input_file_id=str(d.get("input_file_id", "")),
                 completion_window=str(d.get("completion_window", "")), created_at=int_or(d.get("created_at")),
                 request_counts=RequestCounts(int_or(counts.get("total")), int_or(counts.get("completed")),
                                              int_or(counts.get("failed"))),
                 output_file_id=d.get("output_file_id"), error_file_id=d.get("error_file_id"),
                 expires_at=d.get("expires_at"), metadata=d.get("metadata"), errors=list(errors), raw=dict(d))


def file_of(d: Mapping[str, Any]) -> BatchFile:
    return BatchFile(id=str(d.get("id", "")), filename=str(d.get("filename", "")), bytes=int_or(d.get("bytes")),
                     created_at=int_or(d.get("created_at")), purpose=str(d.get("purpose", "")),
                     expires_at=d.get("expires_at"))


def decode_batch(raw: RawReply) -> Batch:
    return batch_of(decode_json(raw))


def decode_file(raw: RawReply) -> BatchFile:
    return file_of(decode_json(raw))


def decode_batches(raw: RawReply) -> BatchPage[Batch]:
    d = decode_json(raw)
    return BatchPage([batch_of(x) for x in d.get("data") or []], bool(d.get("has_more")), d.get("last_id"))


def decode_files(raw: RawReply) -> BatchPage[BatchFile]:
    d = decode_json(raw)
    return BatchPage([file_of(x) for x in d.get("data") or []], bool(d.get("has_more")), d.get("last_id"))


def decode_content(raw: RawReply) -> bytes:
    if raw.status >= 400:
        raise decode_error(raw)
    return raw.body


# --- the input file --------------------------------------------------------------------------------
def request_lines(items: Iterable[Any], *, endpoint: str = ENDPOINTS["chat"], model: str | None = None,
                  defaults: Mapping[str, Any] | None = None) -> bytes:
    """OpenAI batch request lines (JSONL) from batch items: a prompt string, a list of chat
    messages, or a dict of request fields (``prompt``/``messages``/``input``, ``model``,
    ``max_tokens``..., and ``custom_id`` or ``id``; the default custom_id is the item's index).
    An item that is already a request line (``custom_id`` and ``body``) is kept as it is."""
    if endpoint not in ENDPOINTS.values():
        raise BadRequestError(f"endpoint must be one of {', '.join(ENDPOINTS.values())}")
    out: list[bytes] = []
    for i, item in enumerate(items):
        if isinstance(item, Mapping) and "body" in item and "custom_id" in item:
            line = {"method": "POST", "url": endpoint, **item}
            out.append(json.dumps(line, ensure_ascii=False).encode())
            continue
        body: dict[str, Any] = dict(defaults or {})
        custom_id = str(i)
        if isinstance(item, str):
            key = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}[endpoint]
            body[key] = [{"role": "user", "content": item}] if key == "messages" else item
        elif isinstance(item, Mapping):
            custom_id = str(item.get("custom_id", item.get("id", i)))
            body.update({k: v for k, v in item.items() if k not in _NOT_BODY})
            if endpoint == ENDPOINTS["chat"] and "prompt" in body and "messages" not in body:
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        else:  # a list of chat messages
            body["messages"] = [dict(m) for m in item]
        body.setdefault("model", model)
        if not body.get("model"):
            raise BadRequestError(f"item {i}: no model (give model=..., or a `model` in the item)")
        out.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body},
                              ensure_ascii=False).encode())
    if not out:
        raise BadRequestError("no items: a batch needs at least one request")
    return b"\n".join(out) + b"\n"
