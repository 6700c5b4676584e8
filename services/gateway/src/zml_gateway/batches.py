"""The Batch API's HTTP routes (OpenAI's ``/v1/files`` and ``/v1/batches``): HTTP in, HTTP out;
what each operation does is :class:`zmlcore.batch.api.BatchApi`'s (docs/batches.md).

    POST   /v1/files                    multipart: purpose=batch, file=<JSONL>   -> file object
    GET    /v1/files                    ?after=&limit=&order=&purpose=           -> list
    GET    /v1/files/{file_id}                                                  -> file object
    GET    /v1/files/{file_id}/content                                          -> the bytes
    DELETE /v1/files/{file_id}                                                  -> {"deleted": true}
    POST   /v1/batches                  {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                  ?after=&limit=                           -> list
    GET    /v1/batches/{batch_id}                                               -> batch object
    POST   /v1/batches/{batch_id}/cancel                                        -> batch object

Files and batches belong to the API key that made them (``anonymous`` on a gateway without
keys): another key gets 404 for them. An upload is read in pieces, each checked line by line
and spooled as it arrives, so memory stays bounded and an oversized or invalid file is refused
without being kept (413; 400 INVALID_FILE naming its bad lines).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

from python_multipart.multipart import MultipartParser, parse_options_header

from zmlcore.batch.api import BatchApi, Upload
from zmlcore.batch.ids import ANONYMOUS
from zmlcore.config import BUILTIN_POLICIES, ZMLConfig
from zmlcore.errors import BadRequestError, RequestTooLargeError, ZMLError
from zmlcore.messages.validate import clip
from zmlcore.telemetry import tracing
from zml_gateway.access import Access
from zml_gateway.asgi import Receive, Scope, Send, send_json
from zml_gateway.infer.intake import Intake
from zml_gateway.routes import Routes

log = logging.getLogger("zml.gateway.batches")

#: A multipart form's bytes beside the file itself (boundaries, part headers, ``purpose``).
FORM_ROOM = 64 * 1024
#: Largest non-file form field kept (``purpose``).
MAX_FIELD = 1024
MAX_PARTS = 8


class BatchRoutes:
    def __init__(self, cfg: ZMLConfig, api: BatchApi, access: Access, intake: Intake) -> None:
        self.cfg = cfg
        self.api = api
        self.access = access
        self.intake = intake

    @staticmethod
    def policy_names(cfg: ZMLConfig) -> set[str]:
        return set(cfg.all_policies()) | set(BUILTIN_POLICIES)

    def add_to(self, r: Routes) -> None:
        r.add("POST", "/v1/files", self.upload)
        r.add("GET", "/v1/files", self.files)
        r.add("GET", "/v1/files/{file_id}", self.file)
        r.add("DELETE", "/v1/files/{file_id}", self.delete_file)
        r.add("GET", "/v1/files/{file_id}/content", self.content)
        r.add("POST", "/v1/batches", self.create)
        r.add("GET", "/v1/batches", self.batches)
        r.add("GET", "/v1/batches/{batch_id}", self.batch)
        r.add("POST", "/v1/batches/{batch_id}/cancel", self.cancel)

    async def owner(self, scope: Scope) -> str:
        """Whose files and batches: the caller's key, or everyone's on a gateway without keys
        (whoever reaches it is the one tenant; a client address is no identity to own data by)."""
        caller = await self.access.authenticate(scope)
        return caller.identity if self.access.ring.enabled else ANONYMOUS

    # --- files ---------------------------------------------------------------------------------
    async def upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = await self.owner(scope)
        headers = dict(scope["headers"])
        ctype, params = parse_options_header(headers.get(b"content-type", b""))
        boundary = params.get(b"boundary")
        if ctype != b"multipart/form-data" or not boundary:
            raise BadRequestError("POST /v1/files takes multipart/form-data with `purpose` and `file` fields")
        length = headers.get(b"content-length", b"")
        size = int(length) if length.isdigit() else None
        if size is not None and size > self.api.bc.max_file_bytes + FORM_ROOM:
            raise RequestTooLargeError(f"a file of about {size} bytes is over the limit of {self.api.bc.max_file_bytes} "
                                       "bytes ([batch] max_file_bytes)")
        with await self.api.begin_upload(owner) as up:
            form = _Form(boundary, up)
            async for chunk in self._body(receive):
                form.write(chunk)
            form.end()
            if not form.has_file:
                raise BadRequestError("no `file` field: send the JSONL file as the form's `file` part", param="file")
            await send_json(send, 200, await up.finish(form.filename, form.fields.get("purpose", "")))

    async def _body(self, receive: Receive) -> AsyncIterator[bytes]:
        """The request body in pieces; a client that sends nothing for ``body_timeout_s`` gets 408
        (an upload may take long in all, as long as it keeps coming)."""
        timeout = self.cfg.gateway.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), timeout)
            except asyncio.TimeoutError:
                slow = BadRequestError(f"no upload bytes received for {timeout:g} s")
                slow.http_status = 408  # type: ignore[misc]  # like the gateway's other body timeouts
                raise slow from None
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body"):
                return

    async def files(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = await self.owner(scope)
        q = _query(scope)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadRequestError("order must be asc or desc", param="order")
        await send_json(send, 200, await self.api.files(owner, after=q.get("after"), limit=_limit(q, 10_000, 10_000),
                                                        order=order, purpose=q.get("purpose")))

    async def file(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, await self.api.file(await self.owner(scope), scope["path_params"]["file_id"]))

    async def delete_file(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, await self.api.delete_file(await self.owner(scope), scope["path_params"]["file_id"]))

    async def content(self, scope: Scope, receive: Receive, send: Send) -> None:
        rec, chunks = await self.api.content(await self.owner(scope), scope["path_params"]["file_id"])
        first = await anext(chunks, b"")  # a file whose bytes are gone is a 404, before the head
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/octet-stream"), (b"content-length", b"%d" % rec.bytes),
            (b"content-disposition", b'attachment; filename="%s"' % rec.filename.replace('"', "").encode())]})
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    # --- batches -------------------------------------------------------------------------------
    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = await self.owner(scope)
        body = await self.intake.read_body(scope, receive)
        if not tracing.ON:
            await send_json(send, 200, await self.api.create_batch(owner, body))
            return
        parent = tracing.extract_asgi(scope["headers"])
        with tracing.tracer().start_as_current_span("POST /v1/batches", context=parent) as span:
            carrier: dict[str, str] = {}
            tracing.inject(carrier)  # each line's span links to this one
            batch = await self.api.create_batch(owner, body, carrier.get(tracing.TRACEPARENT, ""))
            tracing.set_attrs(span, {"zml.batch.id": batch["id"], "zml.batch.lines": batch["request_counts"]["total"]})
        await send_json(send, 200, batch)

    async def batches(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = await self.owner(scope)
        q = _query(scope)
        await send_json(send, 200, await self.api.batches(owner, after=q.get("after"), limit=_limit(q, 20, 100)))

    async def batch(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, await self.api.batch(await self.owner(scope), scope["path_params"]["batch_id"]))

    async def cancel(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, await self.api.cancel(await self.owner(scope), scope["path_params"]["batch_id"]))


class _Form:
    """A streaming multipart/form-data parser (python-multipart's) feeding the ``file`` part
    into an :class:`Upload` as it arrives and keeping the (small) other fields."""

    def __init__(self, boundary: bytes, up: Upload) -> None:
        self.up = up
        self.fields: dict[str, str] = {}
        self.filename = ""
        self.has_file = False
        self.parts = 0
        self._name = ""
        self._is_file = False
        self._value = bytearray()
        self._hfield = bytearray()
        self._hvalue = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._error: Exception | None = None
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done, "on_part_data": self._data, "on_part_end": self._end})

    def write(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except ZMLError:
            raise
        except Exception as exc:  # python-multipart's own errors: the form is malformed
            if self._error is not None:
                raise self._error from None
            raise BadRequestError(f"malformed multipart body: {clip(str(exc), 120)}") from None
        if self._error is not None:
            raise self._error

    def end(self) -> None:
        self.parser.finalize()
        if self._error is not None:
            raise self._error

    def _begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise BadRequestError(f"more than {MAX_PARTS} form fields")
        self._headers, self._name, self._is_file, self._value = {}, "", False, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._hfield += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._hvalue += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._hfield).lower()] = bytes(self._hvalue)
        self._hfield, self._hvalue = bytearray(), bytearray()

    def _headers_done(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.has_file:
                raise BadRequestError("more than one `file` part: one file per upload", param="file")
            self._is_file = self.has_file = True
            self.filename = params.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            try:
                self.up.feed(data[start:end])
            except Exception as exc:  # raised out of write(), not lost inside the parser
                self._error = exc
                raise
        else:
            self._value += data[start:end]
            if len(self._value) > MAX_FIELD:
                raise BadRequestError(f"form field {clip(self._name, 40)} is longer than {MAX_FIELD} bytes")

    def _end(self) -> None:
        if not self._is_file and self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


def _query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    return {k: v[-1] for k, v in parse_qs(raw, max_num_fields=20).items()}


def _limit(q: dict[str, str], default: int, most: int) -> int:
    text = q.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise BadRequestError(f"limit must be an integer from 1 to {most}", param="limit")
    return int(text)
