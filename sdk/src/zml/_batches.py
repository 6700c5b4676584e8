"""``client.batches`` and ``client.files``: the Batch API (docs/batches.md), sync and async
twins over the sans-I/O :mod:`zml._core.batches`. A batch runs on the server: the client may
go away and come back for the results (``retrieve``/``wait``/``results``).

Example::

    with zml.Client() as client:
        batch = client.batches.submit(["Hello", "Bonjour"], model="meta-llama/llama-3-8b-instruct", max_tokens=32)
        batch = client.batches.wait(batch.id, on_progress=lambda b: print(b.request_counts))
        for row in client.batches.results(batch.id):
            print(row["custom_id"], row["response"]["body"]["choices"][0]["message"]["content"])
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import IO, Any

from zml._batch_models import Batch, BatchFile, BatchPage
from zml._core import batches as core
from zml._core.reply import RawReply
from zml._errors import ConfigError, TimeoutError

__all__ = ["AsyncBatches", "AsyncFiles", "Batches", "Files"]

Send = Callable[[core.ApiCall], RawReply]
AsyncSend = Callable[[core.ApiCall], Awaitable[RawReply]]
FileArg = str | os.PathLike[str] | bytes | IO[bytes]


def unsupported(endpoint: str) -> Any:
    def send(call: core.ApiCall) -> Any:
        raise ConfigError(f"the Batch API is served by the gateway: give the client an http(s):// endpoint "
                          f"(this one is {endpoint})")
    return send


def _read(file: FileArg, filename: str | None) -> tuple[str, bytes]:
    if isinstance(file, bytes):
        return filename or "batch.jsonl", file
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return filename or os.path.basename(os.fspath(file)), fh.read()
    return filename or os.path.basename(str(getattr(file, "name", "batch.jsonl"))), file.read()


def rows(data: bytes) -> list[dict[str, Any]]:
    """The lines of an output or error file, parsed."""
    return [json.loads(line) for line in data.splitlines() if line.strip()]


class Files:
    def __init__(self, send: Send) -> None:
        self._send = send

    def create(self, file: FileArg, purpose: str = "batch", filename: str | None = None) -> BatchFile:
        """Upload a JSONL file of batch requests (a path, bytes or a binary file object)."""
        name, content = _read(file, filename)
        return core.decode_file(self._send(core.upload_file(name, content, purpose)))

    def retrieve(self, file_id: str) -> BatchFile:
        return core.decode_file(self._send(core.get_file(file_id)))

    def list(self, after: str | None = None, limit: int = 100, purpose: str | None = None) -> BatchPage[BatchFile]:
        return core.decode_files(self._send(core.list_files(after, limit, purpose)))

    def delete(self, file_id: str) -> bool:
        return bool(core.decode_json(self._send(core.delete_file(file_id))).get("deleted"))

    def content(self, file_id: str) -> bytes:
        return core.decode_content(self._send(core.file_content(file_id)))


class Batches:
    def __init__(self, send: Send, files: Files, model: str | None = None) -> None:
        self._send = send
        self._files = files
        self._model = model

    def create(self, input_file_id: str, endpoint: str = core.ENDPOINTS["chat"], completion_window: str = "24h",
               metadata: Mapping[str, str] | None = None, *, policy: str | None = None) -> Batch:
        """Start a batch over an uploaded file; ``policy``: the routing policy of its lines
        (``metadata.policy``; default: the deployment's batch policy, the cheapest capacity)."""
        meta = {**(metadata or {}), **({"policy": policy} if policy else {})}
        return core.decode_batch(self._send(core.create_batch(input_file_id, endpoint, completion_window, meta)))

    def submit(self, items: Iterable[Any], *, model: str | None = None, endpoint: str = core.ENDPOINTS["chat"],
               completion_window: str = "24h", metadata: Mapping[str, str] | None = None, policy: str | None = None,
               **defaults: Any) -> Batch:
        """Upload ``items`` (prompts, message lists, or dicts of request fields, as ``infer_batch``
        takes them; ``defaults`` go into every request) and start a batch over them."""
        data = core.request_lines(items, endpoint=endpoint, model=model or self._model, defaults=defaults)
        file = self._files.create(data, filename="batch.jsonl")
        return self.create(file.id, endpoint, completion_window, metadata, policy=policy)

    def retrieve(self, batch_id: str) -> Batch:
        return core.decode_batch(self._send(core.get_batch(batch_id)))

    def list(self, after: str | None = None, limit: int = 20) -> BatchPage[Batch]:
        """One page, newest first."""
        return core.decode_batches(self._send(core.list_batches(after, limit)))

    def cancel(self, batch_id: str) -> Batch:
        return core.decode_batch(self._send(core.cancel_batch(batch_id)))

    def wait(self, batch_id: str, *, poll_s: float = 1.0, timeout: float | None = None,
             on_progress: Callable[[Batch], None] | None = None) -> Batch:
        """Poll until the batch has ended; ``on_progress`` sees every poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.retrieve(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch.done:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout:g} s")
            time.sleep(poll_s)

    def results(self, batch_id: str) -> builtins.list[dict[str, Any]]:
        """Every line's result (output file, then error file): one row per ``custom_id``."""
        batch = self.retrieve(batch_id)
        out: builtins.list[dict[str, Any]] = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                out += rows(self._files.content(file_id))
        return out


class AsyncFiles:
    def __init__(self, send: AsyncSend) -> None:
        self._send = send

    async def create(self, file: FileArg, purpose: str = "batch", filename: str | None = None) -> BatchFile:
        name, content = _read(file, filename)
        return core.decode_file(await self._send(core.upload_file(name, content, purpose)))

    async def retrieve(self, file_id: str) -> BatchFile:
        return core.decode_file(await self._send(core.get_file(file_id)))

    async def list(self, after: str | None = None, limit: int = 100,
                   purpose: str | None = None) -> BatchPage[BatchFile]:
        return core.decode_files(await self._send(core.list_files(after, limit, purpose)))

    async def delete(self, file_id: str) -> bool:
        return bool(core.decode_json(await self._send(core.delete_file(file_id))).get("deleted"))

    async def content(self, file_id: str) -> bytes:
        return core.decode_content(await self._send(core.file_content(file_id)))


class AsyncBatches:
    def __init__(self, send: AsyncSend, files: AsyncFiles, model: str | None = None) -> None:
        self._send = send
        self._files = files
        self._model = model

    async def create(self, input_file_id: str, endpoint: str = core.ENDPOINTS["chat"], completion_window: str = "24h",
                     metadata: Mapping[str, str] | None = None, *, policy: str | None = None) -> Batch:
        meta = {**(metadata or {}), **({"policy": policy} if policy else {})}
        return core.decode_batch(await self._send(core.create_batch(input_file_id, endpoint, completion_window, meta)))

    async def submit(self, items: Iterable[Any], *, model: str | None = None, endpoint: str = core.ENDPOINTS["chat"],
                     completion_window: str = "24h", metadata: Mapping[str, str] | None = None,
                     policy: str | None = None, **defaults: Any) -> Batch:
        data = core.request_lines(items, endpoint=endpoint, model=model or self._model, defaults=defaults)
        file = await self._files.create(data, filename="batch.jsonl")
        return await self.create(file.id, endpoint, completion_window, metadata, policy=policy)

    async def retrieve(self, batch_id: str) -> Batch:
        return core.decode_batch(await self._send(core.get_batch(batch_id)))

    async def list(self, after: str | None = None, limit: int = 20) -> BatchPage[Batch]:
        return core.decode_batches(await self._send(core.list_batches(after, limit)))

    async def cancel(self, batch_id: str) -> Batch:
        return core.decode_batch(await self._send(core.cancel_batch(batch_id)))

    async def wait(self, batch_id: str, *, poll_s: float = 1.0, timeout: float | None = None,
                   on_progress: Callable[[Batch], None] | None = None) -> Batch:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = await self.retrieve(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch.done:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout:g} s")
            await asyncio.sleep(poll_s)

    async def results(self, batch_id: str) -> builtins.list[dict[str, Any]]:
        batch = await self.retrieve(batch_id)
        out: builtins.list[dict[str, Any]] = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                out += rows(await self._files.content(file_id))
        return out
