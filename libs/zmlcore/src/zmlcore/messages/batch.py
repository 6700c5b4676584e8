"""The Batch API's records and work messages (docs/batches.md).

Records live in the KV bucket ``zml_batch_index`` (one per file, one per batch); work goes
through the stream ``ZML_BATCH_WORK``; every answered line is one :class:`LineResult` in
``ZML_BATCH_RESULTS``. The OpenAI JSON a client sees (the file and batch objects, output
lines) is made from these by :mod:`zmlcore.batch.objects`, so the stored form can grow fields
without changing what clients read.
"""

from __future__ import annotations

from typing import Literal

import msgspec

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
#: Statuses after which nothing changes any more.
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
NULL = msgspec.Raw(b"null")
#: Endpoints a batch (and each of its lines) may name.
ENDPOINTS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class FileRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One stored file: an uploaded input (purpose ``batch``) or a batch's output or error
    file (``batch_output``)."""

    id: str
    #: Who may see it: the API key's identity (``key:<id>``, ``static-...``) or "anonymous".
    owner: str
    filename: str
    bytes: int
    created_at: int
    purpose: str = "batch"
    expires_at: int | None = None
    #: Request lines in an input file.
    lines: int = 0
    #: The ``url`` of its lines (an input file), the models their bodies name.
    endpoints: list[str] = []
    models: list[str] = []
    #: Output and error files: the batch that wrote them.
    batch_id: str = ""


class BatchErrorItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One reason a batch failed validation (OpenAI's ``errors.data[]``)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One batch: what was asked, where it stands, and its shards' progress.

    ``progress`` maps a shard number to ``[completed, failed, prompt_tokens,
    completion_tokens]`` of its lines so far; the runner holding a shard overwrites its entry
    (never adds to it), so a shard taken over after a crash recounts from its recorded results
    and nothing is counted twice. ``done`` lists the shards finished.
    """

    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: BatchStatus = "validating"
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[BatchErrorItem] = []
    metadata: dict[str, str] | None = None
    #: The policy its lines route with (``metadata.policy``, else ``[batch] policy``); "" =
    #: the built-in batch policy (cheapest family within ``[batch] latency_target_ms``).
    policy: str = ""
    model: str = ""
    #: Lines in the input file, and the shards they were split into (set when validated).
    total: int = 0
    shards: int = 0
    done: list[int] = []
    progress: dict[str, list[int]] = {}
    #: W3C trace context of the request that created it: each line's span links to it.
    traceparent: str = ""


class BatchTask(msgspec.Struct, kw_only=True):
    """Work on a whole batch: validate and split it (``start``), or write its files (``final``)."""

    batch_id: str
    owner: str


class ShardTask(msgspec.Struct, kw_only=True):
    """A run of consecutive input lines of one batch, carried whole (each line as it was
    uploaded), so that a runner needs nothing else to work on them."""

    batch_id: str
    owner: str
    shard: int
    #: Index (0-based, among the file's request lines) of ``lines[0]``.
    first: int
    lines: list[msgspec.Raw]


class InputLine(msgspec.Struct, kw_only=True):
    """One line of an input file (OpenAI's batch request input)."""

    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class LineResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What became of one line: an answer (``status_code`` 200, ``body`` the reply), an error
    answer (a 4xx/5xx ``status_code``, ``body`` the error), or no answer at all (``error_code``
    such as ``batch_expired``)."""

    line: int
    custom_id: str
    status_code: int = 0
    request_id: str = ""
    #: The reply (or error) JSON as the router sent it; ``null`` when there was none.
    body: msgspec.Raw = NULL
    error_code: str = ""
    error_message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    node_id: str = ""
    family: str = ""
    attempts: int = 0
    ts: float = 0.0
    #: A reply too large for one message, kept in the file store under this name instead.
    spilled: str = ""


class BatchEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A batch's status or counts changed (``zml.batch.events``)."""

    batch_id: str
    status: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    ts: float = 0.0


file_record_decoder = msgspec.json.Decoder(FileRecord)
batch_record_decoder = msgspec.json.Decoder(BatchRecord)
batch_task_decoder = msgspec.json.Decoder(BatchTask)
shard_task_decoder = msgspec.json.Decoder(ShardTask)
input_line_decoder = msgspec.json.Decoder(InputLine)
line_result_decoder = msgspec.json.Decoder(LineResult)
batch_event_decoder = msgspec.json.Decoder(BatchEvent)
