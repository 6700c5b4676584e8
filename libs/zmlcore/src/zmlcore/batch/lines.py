"""Checking a batch input file as it arrives, one line at a time (pure: no I/O).

Every line must be an OpenAI batch request that could run here: a JSON object with a
``custom_id`` unique in the file, ``method`` POST, a ``url`` among the endpoints ZML serves and
a ``body`` that is a valid request of that endpoint (the same rules as the gateway's,
:func:`zmlcore.messages.validate.decode_request`) for a model this deployment serves. Checking
at upload means a file that could never run is refused with a 400 naming its bad lines, before
it costs storage or a runner's time.

The file is fed in pieces as the upload streams in (:meth:`LineChecker.feed`), so memory stays
bounded whatever arrives: a line over the limit is reported and skipped, never buffered whole.

    checker = LineChecker(limits, known_model)
    for piece in upload:
        checker.feed(piece)
    summary = checker.finish()
    if summary.errors: ...400 with summary.message()...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from zmlcore.errors import BadRequestError
from zmlcore.messages.batch import ENDPOINTS, InputLine, input_line_decoder
from zmlcore.messages.validate import clip, decode_request

#: Longest ``custom_id`` (it is echoed in every output line).
MAX_CUSTOM_ID = 512
#: Problems listed in full; the rest are counted.
MAX_LISTED = 20

#: Which body each endpoint takes (InferRequest.kind()).
_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding"}


@dataclass(frozen=True, slots=True)
class LineLimits:
    max_line_bytes: int
    max_lines: int
    max_json_depth: int = 32


@dataclass(frozen=True, slots=True)
class Problem:
    line: int  # 1-based, as an editor shows it
    code: str
    message: str


@dataclass(slots=True)
class Summary:
    """What an input file holds once checked whole."""

    lines: int = 0
    bytes: int = 0
    endpoints: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    #: Problems beyond the first MAX_LISTED.
    more_errors: int = 0

    def message(self) -> str:
        """The 400's message: the first problems, one per line number."""
        shown = "; ".join(f"line {p.line}: {p.message}" for p in self.errors)
        more = f"; and {self.more_errors} more" if self.more_errors else ""
        return f"the file has {len(self.errors) + self.more_errors} invalid line(s): {shown}{more}"


class LineChecker:
    """Feed it the file's bytes in any pieces; :meth:`finish` says what the file holds."""

    def __init__(self, limits: LineLimits, known_model: Callable[[str], bool]) -> None:
        self.limits = limits
        self.known_model = known_model
        self._partial = bytearray()
        self._skipping = False  # inside a line already reported as too long
        self._lineno = 0
        self._ids: set[str] = set()
        self._endpoints: dict[str, None] = {}
        self._models: dict[str, None] = {}
        self.summary = Summary()

    def feed(self, data: bytes) -> None:
        self.summary.bytes += len(data)
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._keep(data[start:])
                return
            piece = data[start:nl]
            start = nl + 1
            if self._skipping:
                self._skipping = False
                self._lineno += 1
                continue
            if self._partial:
                self._partial += piece
                if len(self._partial) > self.limits.max_line_bytes:
                    self._lineno += 1
                    self._too_long(len(self._partial))
                    self._partial.clear()
                    continue
                line = bytes(self._partial)
                self._partial.clear()
            else:
                line = piece
                if len(line) > self.limits.max_line_bytes:
                    self._lineno += 1
                    self._too_long(len(line))
                    continue
            self._lineno += 1
            self._line(line)

    def _keep(self, rest: bytes) -> None:
        """The start of a line whose end has not arrived: kept unless it is already too long."""
        if self._skipping or not rest:
            return
        if len(self._partial) + len(rest) > self.limits.max_line_bytes:
            self._too_long(len(self._partial) + len(rest), more=True)
            self._partial.clear()
            self._skipping = True
            return
        self._partial += rest

    def _too_long(self, size: int, more: bool = False) -> None:
        line = self._lineno + 1 if more else self._lineno
        self._problem(line, "line_too_long", f"{size}{'+' if more else ''} bytes, over the limit of "
                                             f"{self.limits.max_line_bytes} bytes per line")
        self.summary.lines += 1  # it counts as a request line (a bad one)

    def finish(self) -> Summary:
        if self._partial and not self._skipping:
            line = bytes(self._partial)
            self._partial.clear()
            self._lineno += 1
            self._line(line)
        elif self._skipping:
            self._skipping = False
        s = self.summary
        if s.lines == 0 and not s.errors:
            self._problem(0, "empty_file", "no request lines: give one JSON request per line")
        if s.lines > self.limits.max_lines:
            self._problem(0, "too_many_lines",
                          f"{s.lines} request lines, over the limit of {self.limits.max_lines} per file")
        s.endpoints = list(self._endpoints)
        s.models = list(self._models)
        return s

    def _problem(self, line: int, code: str, message: str) -> None:
        if len(self.summary.errors) < MAX_LISTED:
            self.summary.errors.append(Problem(line, code, message))
        else:
            self.summary.more_errors += 1

    def _line(self, raw: bytes) -> None:
        if not raw.strip():
            return  # blank lines (a trailing newline, CRLF leftovers) are not requests
        self.summary.lines += 1
        if self.summary.lines > self.limits.max_lines:
            return  # counted; finish() reports it once
        lineno = self._lineno
        try:
            line = input_line_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._problem(lineno, "invalid_json_line",
                          f"not a batch request (an object with custom_id, method, url, body): {clip(str(exc), 200)[1:-1]}")
            return
        problem = check_line(line, self.limits.max_json_depth, self.known_model, self._models)
        if problem is not None:
            self._problem(lineno, *problem)
            return
        if line.custom_id in self._ids:
            self._problem(lineno, "duplicate_custom_id",
                          f"custom_id {clip(line.custom_id, 80)} appears more than once in the file")
            return
        self._ids.add(line.custom_id)
        self._endpoints.setdefault(line.url, None)


def check_line(line: InputLine, max_depth: int, known_model: Callable[[str], bool],
               models: dict[str, None] | None = None) -> tuple[str, str] | None:
    """(code, message) of what is wrong with one decoded line, or None."""
    if not line.custom_id:
        return "invalid_custom_id", "custom_id must not be empty"
    if len(line.custom_id) > MAX_CUSTOM_ID:
        return "invalid_custom_id", f"custom_id longer than {MAX_CUSTOM_ID} characters"
    if line.method != "POST":
        return "invalid_method", f"method must be POST, not {clip(line.method, 20)}"
    kind = _KIND.get(line.url)
    if kind is None:
        return "invalid_url", f"url must be one of {', '.join(ENDPOINTS)}, not {clip(line.url, 60)}"
    body = bytes(line.body)
    if not body.lstrip().startswith(b"{"):
        return "invalid_body", "body must be a JSON object (the request the endpoint takes)"
    try:
        req = decode_request(body, max_depth=max_depth)
    except BadRequestError as exc:
        return "invalid_body", exc.message
    if req.kind() != kind:
        want = {"chat": "messages", "completion": "prompt", "embedding": "input"}[kind]
        return "invalid_body", f"a {line.url} body needs `{want}`"
    if req.stream:
        return "invalid_body", "batch lines are not streamed: drop `stream`"
    if not known_model(req.model):
        return "model_not_found", f"model {clip(req.model, 80)} is not served by this deployment (see /v1/models)"
    if models is not None:
        models.setdefault(req.model, None)
    return None
