"""gRPC transports (``grpc://host:port``, ``grpcs://`` with TLS): the gateway's ``zml.v1.Zml``
service (docs/grpc.md). :class:`SyncGrpcTransport` on grpcio's blocking API and its twin
:class:`AsyncGrpcTransport` on ``grpc.aio``; both hand the sans-I/O core the same
:class:`~zml._core.RawReply` the HTTP transport does (the reply's ``json`` is the HTTP body), so
decoding, errors and retries are the core's. grpc exceptions become ZML errors here and nowhere
else.

Closing a stream early, or cancelling the awaiting task, cancels the call, which the gateway
turns into a cancel on the node. The client's per-call timeout is the call's gRPC deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import msgspec

from zml._core import (
    InferCall,
    RawReply,
    StreamEvent,
    decode_chunk,
    decode_error,
    routing_from_headers,
    timeout_error,
    trace_headers,
)
from zml._errors import ZMLError, error_class
from zmlcore.rpc import codec
from zmlcore.rpc import status as rpc_status
from zmlcore.rpc import zml_pb2 as pb

__all__ = ["AsyncGrpcStream", "AsyncGrpcTransport", "SyncGrpcStream", "SyncGrpcTransport"]

_INFER = "/zml.v1.Zml/Infer"
_STREAM = "/zml.v1.Zml/InferStream"
_MODELS = "/zml.v1.Zml/ListModels"
_NODES = "/zml.v1.Zml/ListNodes"
#: Largest reply accepted: a reply carries its JSON and the same content as fields, and the
#: gateway's replies are bounded by [nats] max_reply_bytes (64 MiB by default).
MAX_REPLY_BYTES = 160 * 1024 * 1024


def target_of(endpoint: str) -> tuple[str, bool]:
    """``host:port`` and whether to use TLS, from ``grpc://host:port`` / ``grpcs://host:port``."""
    tls = endpoint.startswith("grpcs://")
    target = endpoint.split("://", 1)[1].rstrip("/")
    if ":" not in target.rsplit("]", 1)[-1]:
        target += ":443" if tls else ":50051"
    return target, tls


def _options() -> list[tuple[str, Any]]:
    return [("grpc.max_receive_message_length", MAX_REPLY_BYTES),
            ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]


def _metadata(api_key: str | None, call: InferCall | None = None) -> list[tuple[str, str]]:
    md = [("authorization", f"Bearer {api_key}")] if api_key else []
    if call is not None:
        md += list(call.http_headers().items()) + list(trace_headers().items())
    return md


def _headers(*mds: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for md in mds:
        for key, value in md or ():
            if isinstance(value, str):
                out[key.lower()] = value
    return out


def _error(exc: grpc.RpcError, target: str, call: InferCall | None = None) -> ZMLError | RawReply:
    """The error reply (a RawReply the core decodes) of a failed call that carries a ZML code,
    else the ZMLError of its status alone (unreachable, the client's own deadline...)."""
    trailing = exc.trailing_metadata() or ()
    md = dict(trailing)
    code = md.get(rpc_status.MD_CODE)
    body = md.get(rpc_status.MD_ERROR)
    if isinstance(code, str) and isinstance(body, bytes):
        headers = _headers(trailing)
        if rpc_status.MD_RETRY_AFTER in headers:
            headers["retry-after"] = headers[rpc_status.MD_RETRY_AFTER]
        return RawReply(status=error_class(code).http_status, headers=headers, body=body)
    status = exc.code()
    zml_code = rpc_status.code_for_status(status)
    if zml_code == "TIMEOUT" and call is not None:
        return timeout_error(call.timeout_s, call.request_id)
    if status == grpc.StatusCode.UNAVAILABLE:
        return error_class("CONNECTION_FAILED")(
            f"cannot reach the ZML gateway's gRPC port at {target} ({exc.details()}). "
            "Is `zml up` running with [gateway] grpc_port? Check --endpoint / ZML_ENDPOINT.")
    if status == grpc.StatusCode.UNIMPLEMENTED:
        return error_class("CONNECTION_FAILED")(f"{target} does not serve zml.v1.Zml ({exc.details()})")
    return error_class(zml_code)(f"{target}: {status.name}: {exc.details()}")


def _raise_or_reply(exc: grpc.RpcError, target: str, call: InferCall | None = None) -> RawReply:
    found = _error(exc, target, call)
    if isinstance(found, ZMLError):
        raise found from exc
    return found


def _event(chunk: pb.InferChunk) -> StreamEvent:
    try:
        return decode_chunk(msgspec.json.decode(chunk.json))
    except msgspec.DecodeError:
        return decode_chunk({"choices": [{"index": chunk.index, "text": chunk.text,
                                          "finish_reason": chunk.finish_reason or None}]})


def _stream_error(exc: grpc.RpcError, target: str, call: InferCall) -> StreamEvent:
    found = _error(exc, target, call)
    return StreamEvent("error", error=found if isinstance(found, ZMLError) else decode_error(found))


def _channel_sync(target: str, tls: bool) -> grpc.Channel:
    if tls:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=_options())
    return grpc.insecure_channel(target, options=_options())


def _channel_async(target: str, tls: bool) -> grpc.aio.Channel:
    if tls:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=_options())
    return grpc.aio.insecure_channel(target, options=_options())


def _methods(channel: Any) -> tuple[Any, Any, Any, Any]:
    """The service's four calls on a channel (blocking or grpc.aio: the same builders)."""
    return (channel.unary_unary(_INFER, request_serializer=pb.InferRequest.SerializeToString,
                                response_deserializer=pb.InferReply.FromString),
            channel.unary_stream(_STREAM, request_serializer=pb.InferRequest.SerializeToString,
                                 response_deserializer=pb.InferChunk.FromString),
            channel.unary_unary(_MODELS, request_serializer=pb.ListModelsRequest.SerializeToString,
                                response_deserializer=pb.ListModelsReply.FromString),
            channel.unary_unary(_NODES, request_serializer=pb.ListNodesRequest.SerializeToString,
                                response_deserializer=pb.ListNodesReply.FromString))


class SyncGrpcTransport:
    def __init__(self, endpoint: str, api_key: str | None, timeout: float) -> None:
        self.target, tls = target_of(endpoint)
        self.api_key = api_key
        self.timeout = timeout
        self._channel = _channel_sync(self.target, tls)
        self._infer, self._stream, self._models, self._nodes = _methods(self._channel)

    def infer(self, call: InferCall) -> RawReply:
        try:
            reply, rpc = self._infer.with_call(codec.request_from_body(call.body), timeout=call.timeout_s,
                                               metadata=_metadata(self.api_key, call))
        except grpc.RpcError as exc:
            return _raise_or_reply(exc, self.target, call)
        return RawReply(status=200, headers=_headers(rpc.initial_metadata(), rpc.trailing_metadata()),
                        body=reply.json)

    def _list(self, method: Any, request: Any) -> RawReply:
        try:
            reply = method(request, timeout=self.timeout, metadata=_metadata(self.api_key))
        except grpc.RpcError as exc:
            return _raise_or_reply(exc, self.target)
        return RawReply(status=200, headers={}, body=reply.json)

    def nodes(self) -> RawReply:
        return self._list(self._nodes, pb.ListNodesRequest())

    def models(self) -> RawReply:
        return self._list(self._models, pb.ListModelsRequest())

    def open_stream(self, call: InferCall) -> SyncGrpcStream:
        rpc = self._stream(codec.request_from_body(call.body), timeout=call.timeout_s,
                           metadata=_metadata(self.api_key, call))
        return SyncGrpcStream(rpc, self.target, call)

    def close(self) -> None:
        self._channel.close()


class SyncGrpcStream:
    """Stream events of one InferStream call; ``close()`` before the end cancels it."""

    def __init__(self, rpc: Any, target: str, call: InferCall) -> None:
        self._rpc = rpc
        self._target = target
        self._call = call
        self.headers: dict[str, str] = {}

    def __iter__(self) -> Iterator[StreamEvent]:
        try:
            self.headers = _headers(self._rpc.initial_metadata())
            yield StreamEvent("start", routing=routing_from_headers(self.headers))
            for chunk in self._rpc:
                yield _event(chunk)
        except grpc.RpcError as exc:
            yield _stream_error(exc, self._target, self._call)
            return
        yield StreamEvent("end")

    def close(self) -> None:
        self._rpc.cancel()  # a no-op once the call has ended


class AsyncGrpcTransport:
    def __init__(self, endpoint: str, api_key: str | None, timeout: float) -> None:
        self.target, tls = target_of(endpoint)
        self.api_key = api_key
        self.timeout = timeout
        self._channel = _channel_async(self.target, tls)
        self._infer, self._stream, self._models, self._nodes = _methods(self._channel)

    async def infer(self, call: InferCall) -> RawReply:
        rpc = self._infer(codec.request_from_body(call.body), timeout=call.timeout_s,
                          metadata=_metadata(self.api_key, call))
        try:
            reply = await rpc
            headers = _headers(await rpc.initial_metadata(), await rpc.trailing_metadata())
        except grpc.RpcError as exc:
            return _raise_or_reply(exc, self.target, call)
        finally:
            rpc.cancel()  # a no-op once it has ended; else (the task was cancelled) the gateway cancels upstream
        return RawReply(status=200, headers=headers, body=reply.json)

    async def _list(self, method: Any, request: Any) -> RawReply:
        try:
            reply = await method(request, timeout=self.timeout, metadata=_metadata(self.api_key))
        except grpc.RpcError as exc:
            return _raise_or_reply(exc, self.target)
        return RawReply(status=200, headers={}, body=reply.json)

    async def nodes(self) -> RawReply:
        return await self._list(self._nodes, pb.ListNodesRequest())

    async def models(self) -> RawReply:
        return await self._list(self._models, pb.ListModelsRequest())

    async def open_stream(self, call: InferCall) -> AsyncGrpcStream:
        rpc = self._stream(codec.request_from_body(call.body), timeout=call.timeout_s,
                           metadata=_metadata(self.api_key, call))
        return AsyncGrpcStream(rpc, self.target, call)

    async def aclose(self) -> None:
        await self._channel.close()


class AsyncGrpcStream:
    def __init__(self, rpc: Any, target: str, call: InferCall) -> None:
        self._rpc = rpc
        self._target = target
        self._call = call
        self.headers: dict[str, str] = {}

    async def events(self) -> AsyncIterator[StreamEvent]:
        try:
            self.headers = _headers(await self._rpc.initial_metadata())
            yield StreamEvent("start", routing=routing_from_headers(self.headers))
            async for chunk in self._rpc:
                yield _event(chunk)
        except grpc.RpcError as exc:
            yield _stream_error(exc, self._target, self._call)
            return
        yield StreamEvent("end")

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            self._rpc.cancel()
