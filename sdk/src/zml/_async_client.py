"""``zml.AsyncClient``: the asyncio twin of :class:`zml.Client`, same interface with ``await``.
A thin shell over the sans-I/O core and an async transport (httpx.AsyncClient, grpc.aio or nats-py)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, overload

from zml import _core
from zml._batches import AsyncBatches, AsyncFiles, unsupported
from zml._batch import AudioItem, BatchItem, OnResult, OnTranscription, audio_item, run_async
from zml._errors import ZMLError
from zml._models import (BatchResult, EmbeddingResult, InferMeta, InferResult, Metrics, Policy, Routing, StreamChunk,
                         TranscriptionResult, Usage)
from zml._ratelimit import HeaderScope
from zml._settings import ClientSettings
from zmlcore.messages import NodeState

#: What a call decodes to (each carries routing, metadata, usage and metrics).
R = TypeVar("R", InferResult, EmbeddingResult, TranscriptionResult)

__all__ = ["AsyncClient", "AsyncStream"]

log = logging.getLogger("zml")

PolicyArg = str | Policy | Mapping[str, Any] | None


class _AsyncStream(Protocol):
    headers: dict[str, str]

    def events(self) -> AsyncIterator[_core.StreamEvent]: ...
    async def aclose(self) -> None: ...


class _AsyncTransport(Protocol):
    async def infer(self, call: _core.InferCall) -> _core.RawReply: ...
    async def open_stream(self, call: _core.InferCall) -> _AsyncStream: ...
    async def nodes(self) -> _core.RawReply: ...
    async def models(self) -> _core.RawReply: ...
    async def aclose(self) -> None: ...


class AsyncClient(ClientSettings):
    """Asynchronous ZML client; the same arguments and methods as :class:`zml.Client`.

    Example::

        async with zml.AsyncClient() as client:
            r = await client.infer(model="meta-llama/llama-3-8b-instruct",
                                   messages=[{"role": "user", "content": "Hi"}])
            print(r.choices[0].message.content)

            async for chunk in client.infer_stream(model="meta-llama/llama-3-8b-instruct", prompt="Hi"):
                print(chunk.text, end="")

    Cancelling a task awaiting ``infer()``, or closing a stream early, cancels the request on
    the node.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        api_key: str | None = None,
        timeout: float = 30,
        max_connections: int = 10,
        config_path: str | os.PathLike[str] | None = None,
        *,
        model: str | None = None,
        max_retries: int = 3,
        max_parallel_requests: int | None = None,
        rpm: float | None = None,
        tpm: float | None = None,
        rpd: float | None = None,
        tpd: float | None = None,
        max_request_burst: float | None = None,
        max_token_burst: float | None = None,
        header_bucket_scope: HeaderScope = "minute",
        default_output_tokens: int = _core.DEFAULT_MAX_TOKENS,
        default_request_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        pool = self._configure(
            endpoint, api_key, timeout, max_connections, config_path, model, max_retries, max_parallel_requests,
            {"rpm": rpm, "tpm": tpm, "rpd": rpd, "tpd": tpd, "max_request_burst": max_request_burst,
             "max_token_burst": max_token_burst, "header_bucket_scope": header_bucket_scope},
            default_output_tokens, default_request_kwargs,
        )
        self._transport: _AsyncTransport
        if self.endpoint.startswith(("nats://", "tls://")):
            from zml._transport_nats import AsyncNatsTransport  # imported on use: nats-py is heavy

            self._transport = AsyncNatsTransport(self.endpoint, self.timeout, nats_config=self.nats_config())
        elif self.endpoint.startswith(("grpc://", "grpcs://")):
            from zml._transport_grpc import AsyncGrpcTransport  # the gateway's zml.v1 service (docs/grpc.md)

            self._transport = AsyncGrpcTransport(self.endpoint, self.api_key, self.timeout)
        else:
            from zml._transport_http import AsyncHTTPTransport

            self._transport = AsyncHTTPTransport(self.endpoint, self.api_key, self.timeout, pool)
        # The Batch API (docs/batches.md): the gateway's /v1/files and /v1/batches.
        send = getattr(self._transport, "api", None) or unsupported(self.endpoint)
        self.files = AsyncFiles(send)
        self.batches = AsyncBatches(send, self.files, self.model)

    # ---------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        """Release connections."""
        await self._transport.aclose()

    async def close(self) -> None:
        """Alias of :meth:`aclose`."""
        await self.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- infer
    def _build(self, model: str | None, kwargs: dict[str, Any], stream: bool) -> _core.InferCall:
        extra = dict(kwargs.pop("extra", {}))
        return _core.build_infer(
            model=model or self.model, stream=stream, defaults=self.default_request_kwargs, extra=extra,
            client_timeout_s=self.timeout, default_output_tokens=self.default_output_tokens, **kwargs,
        )

    async def _throttle(self, call: _core.InferCall) -> float:
        if not self._limiter.enabled:
            return 0.0
        delay = self._limiter.reserve(call.est_tokens, time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

    def _after(self, call: _core.InferCall, headers: Mapping[str, str], total_tokens: int | None) -> None:
        if not self._limiter.enabled:
            return
        now = time.monotonic()
        self._limiter.sync(headers, now)
        self._limiter.settle(call.est_tokens, total_tokens, now)

    async def _backoff(self, exc: ZMLError, retries: int, call: _core.InferCall, explicit_id: bool) -> None:
        delay = _core.retry_delay(exc, retries, self.max_retries, random.random())
        if delay is None:
            raise exc
        log.info("zml: %s; retry %d/%d in %.2fs", exc, retries + 1, self.max_retries, delay)
        await asyncio.sleep(delay)
        if not explicit_id:
            call.request_id = call.body["request_id"] = _core.new_request_id()

    async def _infer_call(self, call: _core.InferCall, explicit_id: bool) -> InferResult:
        return await self._call(call, explicit_id, _core.decode_reply)

    async def _call(self, call: _core.InferCall, explicit_id: bool, decode: Callable[[_core.RawReply, _core.InferCall], R]) -> R:
        started = time.monotonic()
        retries, waited = 0, 0.0
        while True:
            waited += await self._throttle(call)
            t0 = time.monotonic()
            try:
                raw = await self._transport.infer(call)
                self._after(call, raw.headers, None)
                result = decode(raw, call)
            except ZMLError as exc:
                await self._backoff(exc, retries, call, explicit_id)
                retries += 1
                continue
            now = time.monotonic()
            self._after(call, {}, result.usage.total_tokens or None)
            result.metrics = Metrics(retries=retries, queue_wait_s=waited, service_s=now - t0, latency_s=now - started)
            if result.metadata.time_to_first_token is None:
                result.metadata.time_to_first_token = now - t0
            return result

    @overload
    async def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: Literal[False] = False, response_format: Any = None,
        **kwargs: Any,
    ) -> InferResult: ...

    @overload
    async def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: Literal[True], response_format: Any = None,
        **kwargs: Any,
    ) -> AsyncStream: ...

    async def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: bool = False, response_format: Any = None,
        **kwargs: Any,
    ) -> InferResult | AsyncStream:
        """Run one inference request (see :meth:`zml.Client.infer`). With ``stream=True`` the
        awaited value is an :class:`AsyncStream` (an async iterator of chunks)."""
        fields = dict(prompt=prompt, messages=messages, max_tokens=max_tokens, temperature=temperature,
                      routing=routing, policy=policy, accelerator_id=accelerator_id,
                      response_format=response_format, extra=kwargs)
        call = self._build(model, fields, stream)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        if stream:
            return AsyncStream(self, call, explicit_id)
        return await self._infer_call(call, explicit_id)

    def infer_stream(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, response_format: Any = None, **kwargs: Any,
    ) -> AsyncStream:
        """An async generator of token chunks (no ``await`` needed): ``async for c in ...``."""
        fields = dict(prompt=prompt, messages=messages, max_tokens=max_tokens, temperature=temperature,
                      routing=routing, policy=policy, accelerator_id=accelerator_id,
                      response_format=response_format, extra=kwargs)
        call = self._build(model, fields, True)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        return AsyncStream(self, call, explicit_id)

    # ---------------------------------------------------------------- batch
    async def infer_batch(
        self,
        items: Iterable[BatchItem],
        *,
        on_result: OnResult | None = None,
        max_parallel_requests: int | None = None,
        **kwargs: Any,
    ) -> BatchResult[InferResult]:
        """Async twin of :meth:`zml.Client.infer_batch`."""
        def one(item: dict[str, Any]) -> Awaitable[InferResult]:
            merged = {**kwargs, **item}
            merged.pop("stream", None)
            return self.infer(**merged)

        return await run_async(one, items, max_parallel_requests or self.max_parallel_requests, on_result)

    async def generate(self, prompt: str, **kwargs: Any) -> InferResult:
        """``await infer(prompt=prompt, **kwargs)`` with the client's ``model``."""
        result: InferResult = await self.infer(kwargs.pop("model", None), prompt, **kwargs)
        return result

    async def generate_batch(self, prompts: Iterable[BatchItem], **kwargs: Any) -> BatchResult[InferResult]:
        """Alias of :meth:`infer_batch`."""
        return await self.infer_batch(prompts, **kwargs)

    agenerate = generate
    agenerate_batch = generate_batch

    # ---------------------------------------------------------------- fleet
    async def _nodes_raw(self) -> list[dict[str, Any]]:
        return _core.decode_nodes(await self._transport.nodes())

    async def nodes(self) -> list[NodeState]:
        """The fleet as the health service sees it."""
        return _core.node_states(await self._nodes_raw())

    async def models(self) -> list[str]:
        """Model ids the fleet serves."""
        return _core.decode_models(await self._transport.models())

    # ---------------------------------------------------------------- embeddings
    async def embed(
        self, model: str | None = None, input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] = "", *,
        dimensions: int | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, **kwargs: Any,
    ) -> EmbeddingResult:
        """Embed ``input`` (see :meth:`zml.Client.embed`)."""
        call = _core.build_embed(
            model=model or self.model, input=input, dimensions=dimensions, routing=routing, policy=policy,
            accelerator_id=accelerator_id, defaults=self.default_request_kwargs, extra=kwargs,
            client_timeout_s=self.timeout,
        )
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        return await self._call(call, explicit_id, _core.decode_embeddings)

    # ---------------------------------------------------------------- audio
    @overload
    async def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: Literal[False] = False,
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult: ...

    @overload
    async def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: Literal[True],
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> AsyncStream: ...

    async def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: bool = False,
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult | AsyncStream:
        """Transcribe ``file`` (see :meth:`zml.Client.transcribe`); with ``stream=True`` the
        awaited value is an :class:`AsyncStream` of the text as it is decoded."""
        call = self._audio_call("transcription", file, model, response_format, language, prompt, temperature,
                                timestamp_granularities, stream, routing, policy, accelerator_id, kwargs)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        if stream:
            return AsyncStream(self, call, explicit_id)
        return await self._call(call, explicit_id, _core.decode_transcription)

    async def translate(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        prompt: str | None = None, temperature: float | None = None, routing: str | None = None,
        policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult:
        """Translate the speech in ``file`` into English text (see :meth:`zml.Client.translate`)."""
        call = self._audio_call("translation", file, model, response_format, None, prompt, temperature, None, False,
                                routing, policy, accelerator_id, kwargs)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        return await self._call(call, explicit_id, _core.decode_transcription)


    async def transcribe_batch(
        self,
        files: Iterable[AudioItem],
        *,
        on_result: OnTranscription | None = None,
        max_parallel_requests: int | None = None,
        **kwargs: Any,
    ) -> BatchResult[TranscriptionResult]:
        """Async twin of :meth:`zml.Client.transcribe_batch`."""
        def one(item: dict[str, Any]) -> Awaitable[TranscriptionResult]:
            merged = {**kwargs, **item}
            merged.pop("stream", None)
            return self.transcribe(**merged)

        return await run_async(one, files, max_parallel_requests or self.max_parallel_requests, on_result, audio_item)

    atranscribe = transcribe
    atranscribe_batch = transcribe_batch


class AsyncStream:
    """Async iterator (and async generator-like: ``aclose()``) of a streamed reply's chunks.

    Leaving ``async with``, ``aclose()``, breaking out of ``async for`` or cancelling the
    consuming task cancels the request on the node. After the end: ``text``, ``routing``,
    ``metadata``, ``usage``, ``metrics``.
    """

    def __init__(self, client: AsyncClient, call: _core.InferCall, explicit_id: bool) -> None:
        self._client = client
        self._call = call
        self._explicit_id = explicit_id
        self._open: _AsyncStream | None = None
        self._gen: AsyncGenerator[StreamChunk, None] | None = None
        self.request_id = call.request_id
        self.routing: Routing | None = None
        self.usage = Usage()
        self.metrics = Metrics()
        self.finish_reason: str | None = None
        self.done = False
        self._parts: list[str] = []
        self._ttft: float | None = None

    @property
    def text(self) -> str:
        return "".join(self._parts)

    @property
    def metadata(self) -> InferMeta:
        return _core.metadata_for(self.routing or Routing(), self.usage, self._ttft)

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    async def __anext__(self) -> StreamChunk:
        return await self.__aiter__().__anext__()

    async def _run(self) -> AsyncGenerator[StreamChunk, None]:
        client, call = self._client, self._call
        started = time.monotonic()
        retries, waited = 0, 0.0
        try:
            while True:
                waited += await client._throttle(call)
                t0 = time.monotonic()
                yielded = False
                try:
                    self._open = await client._transport.open_stream(call)
                    self.request_id = call.request_id
                    async for ev in self._open.events():
                        if ev.kind == "error":
                            assert ev.error is not None
                            raise ev.error
                        if ev.routing is not None:
                            self.routing = ev.routing
                        if ev.usage is not None:
                            self.usage = ev.usage
                        if ev.kind == "end":
                            self.done = True
                            break
                        if ev.kind == "chunk" and ev.chunk is not None:
                            if ev.chunk.finish_reason:
                                self.finish_reason = ev.chunk.finish_reason
                            if not ev.chunk.text and not ev.chunk.finish_reason:
                                continue
                            if self._ttft is None:
                                self._ttft = time.monotonic() - t0
                            self._parts.append(ev.chunk.text)
                            yielded = True
                            yield ev.chunk
                except ZMLError as exc:
                    await self._close_open()
                    if yielded:
                        raise
                    await client._backoff(exc, retries, call, self._explicit_id)
                    retries += 1
                    continue
                now = time.monotonic()
                self.metrics = Metrics(retries=retries, queue_wait_s=waited, service_s=now - t0,
                                       latency_s=now - started)
                client._after(call, self._open.headers if self._open else {}, self.usage.total_tokens or None)
                return
        finally:
            await asyncio.shield(self._close_open())

    async def _close_open(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            await opened.aclose()  # after the end: releases the connection; before: cancels

    async def aclose(self) -> None:
        """Stop reading; a request still running is cancelled on the node."""
        if self._gen is not None:
            await self._gen.aclose()
        await self._close_open()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()
