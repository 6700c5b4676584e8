"""The gateway's gRPC front: ``zml.v1.Zml`` (proto/zml/v1/zml.proto) on ``[gateway] grpc_port``.

Each call is handed to the gateway's own ASGI app as the HTTP request it stands for (a
:class:`_Bridge` plays the client): the same authentication, plans, body bounds, validation,
NATS dispatch, router keepalives and failover as HTTP, with no second copy of that path. The
bridge turns the HTTP answer back into gRPC: a 200 becomes InferReply / InferChunk messages,
an error body the gRPC status of its ZML code (``zmlcore.rpc.status.GRPC_STATUS``) with
``zml-code`` and the ErrorBody in the trailing metadata; routing headers become trailing
metadata (and initial metadata for streams, which know their node before the first chunk).

A call that the client cancels, or whose deadline passes, is an HTTP disconnect to the app,
which cancels the request on its node. The deadline also lowers the request's timeout.
Malformed protobuf is INVALID_ARGUMENT (``BAD_REQUEST``), a message over the body limit
RESOURCE_EXHAUSTED, before the app sees anything.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import msgspec
from grpc_reflection.v1alpha import reflection

from zmlcore.errors import BadRequestError, ConfigError, ErrorBody, ZMLError, error_class
from zmlcore.rpc import codec
from zmlcore.rpc import status as rpc_status
from zmlcore.rpc import zml_pb2 as pb
from zmlcore.reply.sse import SSELineSplitter, data_field
from zmlcore.config import ZMLConfig
from zml_gateway.asgi import Scope

log = logging.getLogger("zml.gateway.grpc")

SERVICE = "zml.v1.Zml"
#: Call metadata the app sees as HTTP headers (everything else stays out of the request).
_PASSED = frozenset({"authorization", "traceparent", "tracestate", "x-zml-id-generated",
                     # the conversation, kept on the node that holds its prefix (as over HTTP)
                     "x-session-id",
                     # flow control: the request's band and latency targets (as over HTTP)
                     "x-zml-priority", "x-zml-ttft-slo-ms", "x-zml-tpot-slo-ms"})
_error_decoder = msgspec.json.Decoder(ErrorBody)
#: Seconds a cancelled call waits for the app to publish the cancel upstream.
_CANCEL_WAIT_S = 5.0


def _client(peer: str) -> tuple[str, int] | None:
    """("ip", port) of a gRPC peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


class _Bridge:
    """One gRPC call as the ASGI client of the gateway app. For a stream, chunks are written
    to the call as the app sends them: gRPC's flow control is the app's backpressure, as a
    slow HTTP client's socket is (the app's bounded buffer then cancels the request)."""

    __slots__ = ("body", "gone", "status", "headers", "data", "ctx", "lines", "error")

    def __init__(self, body: bytes, stream_ctx: grpc.aio.ServicerContext | None) -> None:
        self.body: bytes | None = body
        self.gone = asyncio.Event()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.data: list[bytes] = []
        self.ctx = stream_ctx
        self.lines = SSELineSplitter()
        self.error: bytes | None = None  # the error event that ended a started stream

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            if self.ctx is not None and self.status == 200 and not self.gone.is_set():
                try:
                    await self.ctx.send_initial_metadata(_metadata(self.headers))
                except Exception:  # the call ended under us
                    self.gone.set()
            return
        body = message.get("body", b"")
        if self.ctx is None or self.status != 200:
            self.data.append(body)
            return
        for line in self.lines.feed(body):  # SSE as the app writes it (whole events, or the node's)
            data = data_field(line)
            if data is None or data == b"[DONE]":
                continue  # the blank line ending an event, a comment, the end marker
            if data.startswith((b'{"error"', b'{ "error"')):
                self.error = data
                continue
            if self.gone.is_set():
                return  # as uvicorn does after a disconnect: writes go nowhere, the watch cancels
            try:
                await self.ctx.write(codec.chunk_from_json(data))
            except Exception:  # the call ended under us (client gone, RST): a disconnect to the app
                self.gone.set()
                return


def _metadata(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Routing and rate-limit headers of an HTTP answer as gRPC metadata."""
    out = []
    for name, value in headers:
        key = name.decode("latin-1")
        md = rpc_status.ROUTING_METADATA.get(key)
        if md is not None:
            out.append((md, value.decode("latin-1")))
        elif key.startswith("x-ratelimit-"):
            out.append((key, value.decode("latin-1")))
    return out


async def _abort(ctx: grpc.aio.ServicerContext, data: bytes, status: int,
                 headers: list[tuple[bytes, bytes]]) -> None:
    """End the call with the gRPC status of an error body's ZML code."""
    try:
        detail = _error_decoder.decode(data).error
        code, message, retry_after = detail.code or "INTERNAL", detail.message, detail.retry_after
    except (msgspec.DecodeError, msgspec.ValidationError):
        exc = error_class("BACKEND_ERROR" if status >= 500 else "BAD_REQUEST")(f"HTTP {status}")
        code, message, retry_after, data = exc.code, exc.message, None, msgspec.json.encode(exc.to_body())
    if retry_after is None:
        for name, value in headers:
            if name == b"retry-after":
                retry_after = float(value)
    md = [*rpc_status.error_metadata(data, code, retry_after), *_metadata(headers)]
    await ctx.abort(rpc_status.status_for(code), message, trailing_metadata=tuple(md))


class ZmlService:
    """The zml.v1.Zml methods over the gateway app (``app``: the ASGI app HTTP serves)."""

    def __init__(self, app: Any, cfg: ZMLConfig) -> None:
        self.app = app
        self.cfg = cfg

    def _scope(self, method: str, path: str, ctx: grpc.aio.ServicerContext, size: int) -> Scope:
        headers = [(b"content-length", str(size).encode())] if method == "POST" else []
        for key, value in ctx.invocation_metadata() or ():
            if key in _PASSED and isinstance(value, str):
                headers.append((key.encode(), value.encode("latin-1", "replace")))
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "2", "method": method,
                "scheme": "grpc", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                "headers": headers, "client": _client(ctx.peer() or ""), "server": None}

    def _decode(self, raw: bytes, ctx: grpc.aio.ServicerContext, stream: bool) -> tuple[str, bytes]:
        try:
            req = pb.InferRequest.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError (malformed bytes, bad UTF-8)
            raise BadRequestError(f"the request is not a zml.v1.InferRequest: {exc}") from None
        remaining = ctx.time_remaining()
        d = self.cfg.defaults
        cap = None if remaining is None else max(1, int(min(remaining, d.max_request_timeout_s) * 1000))
        return codec.request_body(req, stream=stream, max_depth=d.max_json_depth, timeout_cap_ms=cap)

    async def _run(self, ctx: grpc.aio.ServicerContext, method: str, path: str, body: bytes,
                   stream: bool = False) -> _Bridge:
        """Serve ``method path`` with ``body`` through the app; abort the call on an error."""
        bridge = _Bridge(body, ctx if stream else None)
        scope = self._scope(method, path, ctx, len(body))
        task = asyncio.ensure_future(self.app(scope, bridge.receive, bridge.send))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:  # the client cancelled or its deadline passed
            bridge.gone.set()  # the app sees a disconnect and cancels the request upstream
            await asyncio.wait((task,), timeout=_CANCEL_WAIT_S)
            raise
        if bridge.status != 200:
            if bridge.status == 0:  # nothing sent: the app saw the client go
                await ctx.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
            await _abort(ctx, b"".join(bridge.data), bridge.status, bridge.headers)
        return bridge

    async def _infer(self, raw: bytes, ctx: grpc.aio.ServicerContext, stream: bool) -> _Bridge:
        try:
            path, body = self._decode(raw, ctx, stream)
        except ZMLError as exc:
            await _abort(ctx, msgspec.json.encode(exc.to_body()), exc.http_status, [])
            raise AssertionError("unreachable") from exc  # abort raises
        return await self._run(ctx, "POST", path, body, stream)

    async def infer(self, raw: bytes, ctx: grpc.aio.ServicerContext) -> pb.InferReply:
        bridge = await self._infer(raw, ctx, stream=False)
        # Trailing only: initial metadata of its own would cost grpc one more batch per call.
        ctx.set_trailing_metadata(tuple(_metadata(bridge.headers)))
        return codec.reply_from_json(b"".join(bridge.data))

    async def infer_stream(self, raw: bytes, ctx: grpc.aio.ServicerContext) -> None:
        bridge = await self._infer(raw, ctx, stream=True)
        if bridge.error is not None:
            await _abort(ctx, bridge.error, 502, bridge.headers)
        ctx.set_trailing_metadata(tuple(_metadata(bridge.headers)))

    async def list_models(self, raw: bytes, ctx: grpc.aio.ServicerContext) -> pb.ListModelsReply:
        bridge = await self._run(ctx, "GET", "/v1/models", b"")
        return codec.models_from_json(b"".join(bridge.data))

    async def list_nodes(self, raw: bytes, ctx: grpc.aio.ServicerContext) -> pb.ListNodesReply:
        bridge = await self._run(ctx, "GET", "/v1/nodes", b"")
        return codec.nodes_from_json(b"".join(bridge.data))

    def handler(self) -> grpc.GenericRpcHandler:
        # Requests arrive as bytes (no deserializer): a malformed message is our
        # INVALID_ARGUMENT with a ZML code, not grpc's own deserialization failure.
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Infer": grpc.unary_unary_rpc_method_handler(
                self.infer, response_serializer=pb.InferReply.SerializeToString),
            "InferStream": grpc.unary_stream_rpc_method_handler(
                self.infer_stream, response_serializer=pb.InferChunk.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, response_serializer=pb.ListModelsReply.SerializeToString),
            "ListNodes": grpc.unary_unary_rpc_method_handler(
                self.list_nodes, response_serializer=pb.ListNodesReply.SerializeToString),
        })


class GrpcFront:
    """The gRPC server beside uvicorn in the gateway process (``start`` / ``stop``)."""

    def __init__(self, app: Any, cfg: ZMLConfig, body_limit: int, host: str, port: int,
                 reuse_port: bool = False) -> None:
        self.service = ZmlService(app, cfg)
        self.reuse_port = reuse_port  # several gateway processes on one port (`zml up`)
        self.cfg = cfg
        #: the HTTP body limit ([gateway] max_body_bytes, or NATS max_payload when smaller)
        self.body_limit = body_limit
        self.host = host
        self.port = port
        self.server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the port (a free one when ``port`` is 0)."""
        g = self.cfg.gateway
        options = [
            ("grpc.max_receive_message_length", self.body_limit),
            ("grpc.max_metadata_size", g.max_header_bytes),
            # Ping idle-looking connections: a client that vanished without a FIN is found
            # within ~40 s and its calls cancelled (and so cancelled on their nodes).
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_connection_idle_ms", 300_000),
            # grpc shares ports by default: only when asked, like the HTTP port.
            ("grpc.so_reuseport", 1 if self.reuse_port else 0),
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((self.service.handler(),))
        reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        if g.tls_cert_file:  # the HTTP port's certificate (and client CA: mutual TLS) here too
            with open(g.tls_cert_file, "rb") as f:
                cert = f.read()
            with open(g.tls_key_file or g.tls_cert_file, "rb") as f:
                key = f.read()
            ca = None
            if g.tls_client_ca_file:
                with open(g.tls_client_ca_file, "rb") as f:
                    ca = f.read()
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
            try:
                bound = server.add_secure_port(address, creds)
            except RuntimeError:
                bound = 0
        else:
            try:
                bound = server.add_insecure_port(address)
            except RuntimeError:  # grpc raises where it used to return 0
                bound = 0
        if not bound:
            raise ConfigError(f"gRPC could not listen on {address} ([gateway] grpc_port)")
        await server.start()
        self.server = server
        self.port = int(bound)
        log.info("gRPC zml.v1.Zml on %s:%d", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=5)


__all__ = ["GrpcFront", "ZmlService", "SERVICE"]

