"""Batch running shared by both clients: items in, results in input order, a callback per item
as it completes. One failure never sinks the batch: it lands in ``errors[i]``."""

from __future__ import annotations

import asyncio
import threading
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import IO, Any, TypeVar

from zml._models import BatchResult, InferResult, TranscriptionResult

__all__ = ["AudioItem", "BatchItem", "OnResult", "OnTranscription", "audio_item", "normalize_item", "run_async",
           "run_sync"]

#: A prompt string, a list of chat messages, or a dict of ``infer()`` keyword arguments.
BatchItem = str | Sequence[Mapping[str, Any]] | Mapping[str, Any]
#: An audio file (a path, its bytes, a binary file) or a dict of ``transcribe()`` keyword arguments.
AudioItem = str | os.PathLike[str] | bytes | IO[bytes] | Mapping[str, Any]
#: ``on_result(index, result, error)``: exactly one of result and error is None.
OnResult = Callable[[int, InferResult | None, BaseException | None], None]
#: The same contract for ``transcribe_batch``.
OnTranscription = Callable[[int, TranscriptionResult | None, BaseException | None], None]

R = TypeVar("R")


def normalize_item(item: BatchItem) -> dict[str, Any]:
    """The ``infer()`` keyword arguments of one batch item."""
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, Mapping):
        return dict(item)
    return {"messages": [dict(m) for m in item]}


def audio_item(item: AudioItem) -> dict[str, Any]:
    """The ``transcribe()`` keyword arguments of one ``transcribe_batch`` item."""
    if isinstance(item, Mapping):
        return dict(item)
    return {"file": item}


def run_sync(
    fn: Callable[[dict[str, Any]], R],
    items: Iterable[Any],
    max_parallel: int,
    on_result: Callable[[int, R | None, BaseException | None], None] | None,
    normalize: Callable[[Any], dict[str, Any]] = normalize_item,
) -> BatchResult[R]:
    todo = list(items)
    results: list[R | None] = [None] * len(todo)
    errors: list[BaseException | None] = [None] * len(todo)
    next_index = iter(range(len(todo)))
    lock = threading.Lock()
    stop = threading.Event()
    crash: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            res: R | None = None
            err: BaseException | None = None
            try:
                res = fn(normalize(todo[i]))
            except Exception as exc:  # one failure never sinks the batch
                err = exc
            with lock:
                results[i], errors[i] = res, err
                if on_result is not None and not stop.is_set():
                    try:
                        on_result(i, res, err)
                    except BaseException as exc:  # the callback's own failure stops the batch
                        crash.append(exc)
                        stop.set()

    threads = [threading.Thread(target=worker, name=f"zml-batch-{n}", daemon=True)
               for n in range(max(1, min(max_parallel, len(todo))))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)
    except BaseException:
        stop.set()
        raise
    if crash:
        raise crash[0]
    return BatchResult(results=results, errors=errors)


async def run_async(
    fn: Callable[[dict[str, Any]], Awaitable[R]],
    items: Iterable[Any],
    max_parallel: int,
    on_result: Callable[[int, R | None, BaseException | None], None] | None,
    normalize: Callable[[Any], dict[str, Any]] = normalize_item,
) -> BatchResult[R]:
    todo = list(items)
    results: list[R | None] = [None] * len(todo)
    errors: list[BaseException | None] = [None] * len(todo)
    next_index = iter(range(len(todo)))

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index goes to exactly one worker
            res: R | None = None
            err: BaseException | None = None
            try:
                res = await fn(normalize(todo[i]))
            except Exception as exc:
                err = exc
            results[i], errors[i] = res, err
            if on_result is not None:
                on_result(i, res, err)

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, min(max_parallel, len(todo))))]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return BatchResult(results=results, errors=errors)
