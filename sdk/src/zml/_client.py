"""``zml.Client``: the synchronous client. A thin shell over the sans-I/O core (``_core``) and a
sync transport: ``httpx.Client`` for ``http(s)://``, grpcio for ``grpc(s)://``, the NATS bridge
for ``nats://``."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, overload

from zml import _core
from zml._batches import Batches, Files, unsupported
from zml._batch import AudioItem, BatchItem, OnResult, OnTranscription, audio_item, run_sync
from zml._errors import ZMLError
from zml._models import (BatchResult, EmbeddingResult, InferMeta, InferResult, Metrics, Policy, Routing, StreamChunk,
                         TranscriptionResult, Usage)
from zml._ratelimit import HeaderScope
from zml._settings import ClientSettings
from zmlcore.messages import NodeState

#: What a call decodes to (each carries routing, metadata, usage and metrics).
R = TypeVar("R", InferResult, EmbeddingResult, TranscriptionResult)

__all__ = ["Client", "Stream", "fleet_families"]

log = logging.getLogger("zml")

PolicyArg = str | Policy | Mapping[str, Any] | None


class _SyncStream(Protocol):
    headers: dict[str, str]

    def __iter__(self) -> Iterator[_core.StreamEvent]: ...
    def close(self) -> None: ...


class _SyncTransport(Protocol):
    def infer(self, call: _core.InferCall) -> _core.RawReply: ...
    def open_stream(self, call: _core.InferCall) -> _SyncStream: ...
    def nodes(self) -> _core.RawReply: ...
    def models(self) -> _core.RawReply: ...
    def close(self) -> None: ...


class Client(ClientSettings):
    """Synchronous ZML client.

    Example::

        import zml

        with zml.Client() as client:          # ZML_ENDPOINT, ZML_API_KEY or zml.toml
            r = client.infer("meta-llama/llama-3-8b-instruct", "Hello", max_tokens=32)
            print(r.text, r.metadata.accelerator_id)

    ``endpoint`` is ``http(s)://gateway``, ``grpc(s)://gateway:grpc_port`` (docs/grpc.md) or
    ``nats://server`` (straight to the routers).
    Transient errors are retried ``max_retries`` times; ``rpm``/``tpm``/``rpd``/``tpd`` turn on
    the client-side rate limiter; ``default_request_kwargs`` apply to every call.
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
        self._lock = threading.Lock()
        self._transport: _SyncTransport
        if self.endpoint.startswith(("nats://", "tls://")):
            from zml._transport_nats import SyncNatsTransport  # imported on use: nats-py is heavy

            self._transport = SyncNatsTransport(self.endpoint, self.timeout, nats_config=self.nats_config())
        elif self.endpoint.startswith(("grpc://", "grpcs://")):
            from zml._transport_grpc import SyncGrpcTransport  # the gateway's zml.v1 service (docs/grpc.md)

            self._transport = SyncGrpcTransport(self.endpoint, self.api_key, self.timeout)
        else:
            from zml._transport_http import SyncHTTPTransport

            self._transport = SyncHTTPTransport(self.endpoint, self.api_key, self.timeout, pool)
        # The Batch API (docs/batches.md): the gateway's /v1/files and /v1/batches.
        send = getattr(self._transport, "api", None) or unsupported(self.endpoint)
        self.files = Files(send)
        self.batches = Batches(send, self.files, self.model)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release connections (and the NATS bridge thread)."""
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---------------------------------------------------------------- infer
    def _build(self, model: str | None, kwargs: dict[str, Any], stream: bool) -> _core.InferCall:
        extra = dict(kwargs.pop("extra", {}))
        return _core.build_infer(
            model=model or self.model, stream=stream, defaults=self.default_request_kwargs, extra=extra,
            client_timeout_s=self.timeout, default_output_tokens=self.default_output_tokens, **kwargs,
        )

    def _throttle(self, call: _core.InferCall) -> float:
        if not self._limiter.enabled:
            return 0.0
        with self._lock:
            delay = self._limiter.reserve(call.est_tokens, time.monotonic())
        if delay > 0:
            time.sleep(delay)
        return delay

    def _after(self, call: _core.InferCall, headers: Mapping[str, str], total_tokens: int | None) -> None:
        if not self._limiter.enabled:
            return
        with self._lock:
            now = time.monotonic()
            self._limiter.sync(headers, now)
            self._limiter.settle(call.est_tokens, total_tokens, now)

    def _backoff(self, exc: ZMLError, retries: int, call: _core.InferCall, explicit_id: bool) -> None:
        delay = _core.retry_delay(exc, retries, self.max_retries, random.random())
        if delay is None:
            raise exc
        log.info("zml: %s; retry %d/%d in %.2fs", exc, retries + 1, self.max_retries, delay)
        time.sleep(delay)
        if not explicit_id:
            call.request_id = call.body["request_id"] = _core.new_request_id()

    def _infer_call(self, call: _core.InferCall, explicit_id: bool) -> InferResult:
        return self._call(call, explicit_id, _core.decode_reply)

    def _call(self, call: _core.InferCall, explicit_id: bool, decode: Callable[[_core.RawReply, _core.InferCall], R]) -> R:
        started = time.monotonic()
        retries, waited = 0, 0.0
        while True:
            waited += self._throttle(call)
            t0 = time.monotonic()
            try:
                raw = self._transport.infer(call)
                self._after(call, raw.headers, None)
                result = decode(raw, call)
            except ZMLError as exc:
                self._backoff(exc, retries, call, explicit_id)
                retries += 1
                continue
            now = time.monotonic()
            self._after(call, {}, result.usage.total_tokens or None)
            result.metrics = Metrics(retries=retries, queue_wait_s=waited, service_s=now - t0, latency_s=now - started)
            if result.metadata.time_to_first_token is None:
                result.metadata.time_to_first_token = now - t0
            return result

    @overload
    def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: Literal[False] = False, response_format: Any = None,
        **kwargs: Any,
    ) -> InferResult: ...

    @overload
    def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: Literal[True], response_format: Any = None,
        **kwargs: Any,
    ) -> Stream: ...

    def infer(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, stream: bool = False, response_format: Any = None,
        **kwargs: Any,
    ) -> InferResult | Stream:
        """Run one inference request and return its result (or a :class:`Stream` when
        ``stream=True``).

        ``prompt`` (completions) or ``messages`` (chat); ``routing``/``policy`` pick a policy
        by name (``policy`` also takes a :class:`zml.Policy`); ``accelerator_id`` pins a node.
        Other keyword arguments (``top_p``, ``stop``, ``timeout``, ``request_id``...) go with
        the request. ``max_tokens`` defaults to 512 and ``temperature`` to 0.7 unless
        ``default_request_kwargs`` says otherwise.
        """
        fields = dict(prompt=prompt, messages=messages, max_tokens=max_tokens, temperature=temperature,
                      routing=routing, policy=policy, accelerator_id=accelerator_id,
                      response_format=response_format, extra=kwargs)
        call = self._build(model, fields, stream)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        if stream:
            return Stream(self, call, explicit_id)
        return self._infer_call(call, explicit_id)

    def infer_stream(
        self, model: str | None = None, prompt: str | Sequence[str] | None = None, *,
        messages: Sequence[Mapping[str, Any]] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, response_format: Any = None, **kwargs: Any,
    ) -> Stream:
        """``infer(..., stream=True)``: iterate the returned :class:`Stream` for chunks."""
        return self.infer(model, prompt, messages=messages, max_tokens=max_tokens, temperature=temperature,
                          routing=routing, policy=policy, accelerator_id=accelerator_id, stream=True,
                          response_format=response_format, **kwargs)

    # ---------------------------------------------------------------- batch
    def infer_batch(
        self,
        items: Iterable[BatchItem],
        *,
        on_result: OnResult | None = None,
        max_parallel_requests: int | None = None,
        **kwargs: Any,
    ) -> BatchResult[InferResult]:
        """Run many requests, ``max_parallel_requests`` at a time; results in input order.

        Each item is a prompt, a list of chat messages, or a dict of ``infer()`` arguments;
        ``kwargs`` apply to every item. ``on_result(index, result, error)`` is called (from
        one thread at a time) as each item completes, so a crash loses only what was in
        flight. A failed item's error is in ``errors[index]``; it never stops the batch.
        """
        def one(item: dict[str, Any]) -> InferResult:
            merged = {**kwargs, **item}
            merged.pop("stream", None)
            result: InferResult = self.infer(**merged)
            return result

        return run_sync(one, items, max_parallel_requests or self.max_parallel_requests, on_result)

    def generate(self, prompt: str, **kwargs: Any) -> InferResult:
        """``infer(prompt=prompt, **kwargs)`` with the client's ``model`` (batch-client style)."""
        result: InferResult = self.infer(kwargs.pop("model", None), prompt, **kwargs)
        return result

    def generate_batch(self, prompts: Iterable[BatchItem], **kwargs: Any) -> BatchResult[InferResult]:
        """Alias of :meth:`infer_batch`."""
        return self.infer_batch(prompts, **kwargs)

    # ---------------------------------------------------------------- fleet
    def _nodes_raw(self) -> list[dict[str, Any]]:
        return _core.decode_nodes(self._transport.nodes())

    def nodes(self) -> list[NodeState]:
        """The fleet as the health service sees it (``GET /v1/nodes`` or NATS)."""
        return _core.node_states(self._nodes_raw())

    def models(self) -> list[str]:
        """Model ids the fleet serves."""
        return _core.decode_models(self._transport.models())

    # ---------------------------------------------------------------- embeddings
    def embed(
        self, model: str | None = None, input: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] = "", *,
        dimensions: int | None = None, routing: str | None = None, policy: PolicyArg = None,
        accelerator_id: str | None = None, **kwargs: Any,
    ) -> EmbeddingResult:
        """Embed ``input`` (a string, strings, or token ids) with an embedding model: one vector
        per input, in input order, routed like ``infer()`` (``routing``/``policy``,
        ``accelerator_id``) and retried the same way. Other keyword arguments (``user``,
        ``encoding_format``, ``timeout``, ``request_id``) go with the request.

        Example::

            r = client.embed("BAAI/bge-small-en-v1.5", ["a cat", "a dog"])
            print(len(r.embeddings), r.routing.node_id)
        """
        call = _core.build_embed(
            model=model or self.model, input=input, dimensions=dimensions, routing=routing, policy=policy,
            accelerator_id=accelerator_id, defaults=self.default_request_kwargs, extra=kwargs,
            client_timeout_s=self.timeout,
        )
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        return self._call(call, explicit_id, _core.decode_embeddings)

    # ---------------------------------------------------------------- audio
    @overload
    def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: Literal[False] = False,
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult: ...

    @overload
    def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: Literal[True],
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> Stream: ...

    def transcribe(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        language: str | None = None, prompt: str | None = None, temperature: float | None = None,
        timestamp_granularities: Sequence[str] | None = None, stream: bool = False,
        routing: str | None = None, policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult | Stream:
        """Transcribe ``file`` (a path, bytes, a binary file or ``(filename, bytes)``) with a
        speech-to-text model (``[models."NAME"] audio = true``): OpenAI's
        ``/v1/audio/transcriptions``, routed and retried like ``infer()``. ``response_format``:
        ``json`` (default), ``text``, ``verbose_json``, ``srt``, ``vtt``; ``stream=True`` returns
        a :class:`Stream` of the text as it is decoded. Other keyword arguments are OpenAI's
        form fields (``chunking_strategy``, ``include``...) or ZML's (``timeout``,
        ``request_id``, ``session``).

        Example::

            r = client.transcribe("meeting.wav", model="whisper-1", response_format="verbose_json")
            print(r.text, r.duration, r.routing.node_id)
        """
        call = self._audio_call("transcription", file, model, response_format, language, prompt, temperature,
                                timestamp_granularities, stream, routing, policy, accelerator_id, kwargs)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        if stream:
            return Stream(self, call, explicit_id)
        return self._call(call, explicit_id, _core.decode_transcription)

    def translate(
        self, file: _core.AudioFile, model: str | None = None, *, response_format: str | None = None,
        prompt: str | None = None, temperature: float | None = None, routing: str | None = None,
        policy: PolicyArg = None, accelerator_id: str | None = None, **kwargs: Any,
    ) -> TranscriptionResult:
        """Translate the speech in ``file`` into English text (OpenAI's ``/v1/audio/translations``);
        the arguments and result of :meth:`transcribe`."""
        call = self._audio_call("translation", file, model, response_format, None, prompt, temperature, None, False,
                                routing, policy, accelerator_id, kwargs)
        explicit_id = "request_id" in kwargs or "request_id" in self.default_request_kwargs
        return self._call(call, explicit_id, _core.decode_transcription)


    def transcribe_batch(
        self,
        files: Iterable[AudioItem],
        *,
        on_result: OnTranscription | None = None,
        max_parallel_requests: int | None = None,
        **kwargs: Any,
    ) -> BatchResult[TranscriptionResult]:
        """Transcribe many files, ``max_parallel_requests`` at a time; results in input order,
        with :meth:`infer_batch`'s contract: ``on_result(index, result, error)`` as each one
        completes (one call at a time), a failure in ``errors[index]`` never stopping the batch.
        Each item is a file (path, bytes, binary file) or a dict of :meth:`transcribe`
        arguments (``{"file": "a.wav", "language": "fr"}``); ``kwargs`` apply to every item."""
        def one(item: dict[str, Any]) -> TranscriptionResult:
            merged = {**kwargs, **item}
            merged.pop("stream", None)
            result: TranscriptionResult = self.transcribe(**merged)
            return result

        return run_sync(one, files, max_parallel_requests or self.max_parallel_requests, on_result, audio_item)


class Stream:
    """Chunks of a streamed reply. Iterate it; ``close()`` (or leaving ``with``, or breaking
    out of the loop) cancels the request on the node.

    Example::

        with client.infer_stream("meta-llama/llama-3-8b-instruct", "Hi") as stream:
            for chunk in stream:
                print(chunk.text, end="")
        print(stream.routing.node_id)

    After the end: ``text`` (everything), ``routing``, ``metadata``, ``usage``, ``metrics``.
    """

    def __init__(self, client: Client, call: _core.InferCall, explicit_id: bool) -> None:
        self._client = client
        self._call = call
        self._explicit_id = explicit_id
        self._open: _SyncStream | None = None
        self._gen: Generator[StreamChunk, None, None] | None = None
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

    def __iter__(self) -> Iterator[StreamChunk]:
        if self._gen is None:
            self._gen = self._run()
        return self._gen

    def __next__(self) -> StreamChunk:
        return next(iter(self))

    def _run(self) -> Generator[StreamChunk, None, None]:
        client, call = self._client, self._call
        started = time.monotonic()
        retries, waited = 0, 0.0
        try:
            while True:
                waited += client._throttle(call)
                t0 = time.monotonic()
                yielded = False
                try:
                    self._open = client._transport.open_stream(call)
                    self.request_id = call.request_id
                    for ev in self._open:
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
                    self._close_open()
                    if yielded:
                        raise
                    client._backoff(exc, retries, call, self._explicit_id)
                    retries += 1
                    continue
                now = time.monotonic()
                self.metrics = Metrics(retries=retries, queue_wait_s=waited, service_s=now - t0,
                                       latency_s=now - started)
                client._after(call, self._open.headers if self._open else {}, self.usage.total_tokens or None)
                return
        finally:
            self._close_open()

    def _close_open(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.close()  # after the end: releases the connection; before: cancels

    def close(self) -> None:
        """Stop reading; a request still running is cancelled on the node."""
        if self._gen is not None:
            self._gen.close()  # runs the generator's finally: closes (cancels) the transport stream
        self._close_open()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def fleet_families(endpoint: str, api_key: str | None, config_path: str | os.PathLike[str] | None,
                   timeout_s: float) -> list[str]:
    """The families of the nodes of the fleet at ``endpoint``, asked once and without retries
    over whichever transport the endpoint names: how ``zml.Policy`` learns of families registered
    at run time (``zml/__init__.py`` installs it into :mod:`zml._fleet`)."""
    with Client(endpoint, api_key, timeout_s, 1, config_path, max_retries=0) as client:
        return [n["family"] for n in client._nodes_raw() if isinstance(n.get("family"), str)]
