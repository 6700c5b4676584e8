"""The HTTP gateway as a raw ASGI app (no framework: the per-request path is a handful of
dict lookups, a NATS request and a write).

Routes: POST /v1/chat/completions, POST /v1/completions (OpenAI-compatible, streaming or not),
POST /v1/embeddings, GET /v1/models, GET /v1/models/{id}, GET /v1/nodes,
GET /healthz; any other path is 404, a known path with the wrong
method 405. The body is validated here with the router's own rules (zmlcore.messages.validate), so a
bad request is a 400 before it costs a NATS round trip, and then goes to the front-door subject ``zml.gateway.infer`` as is.
Every answer that is not a 200 carries OpenAI's error body (``message``, ``type``, ``code``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.messages import frontdoor
from zmlcore.bus.publish import publish
from zmlcore.reply import routingmeta
from zmlcore.reply import streamframe
from zmlcore.telemetry import tracing
from zmlcore.config import ZMLConfig
from zmlcore.fleet.costs import CostTable
from zmlcore.reply.exchange import Exchange, parts_buffer
from zmlcore.errors import (
    BackendError,
    MethodNotAllowedError,
    NoHealthyNodesError,
    NotFoundError,
    QueueFullError,
    BadRequestError,
    RequestTooLargeError,
    StreamInterruptedError,
    TimeoutError,
    ZMLError,
    error_class,
)
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.bus.link import link_of
from zmlcore.messages import NodeState
from zmlcore.access.apikeys import KeyRing
from zmlcore.access.identity import config_owner
from zml_gateway.owners import InFlight
from zmlcore.reply.streamseq import SeqCheck
from zml_gateway import metrics
from zml_gateway import observe as gateway_tracing
from zml_gateway.access import Access, Caller, RateLimited
from zmlcore.messages.validate import check_request_id, clip, decode_request, request_timeout_s
from zml_gateway.models import model_list, model_object

log = logging.getLogger("zml.gateway")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_encode = msgspec.json.encode


_ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/embeddings": "POST", "/v1/models": "GET",
           "/v1/nodes": "GET", "/healthz": "GET"}
#: Room left in a NATS message for our headers when the body limit follows max_payload.
_HEADER_ROOM = 4096

_JSON = (b"content-type", b"application/json")
#: Stream messages that carry Zml-Seq (an error ends the stream whatever its number).
_SEQUENCED = ("start", subjects.STREAM_CHUNK, subjects.STREAM_EVENTS, subjects.STREAM_END)
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _length(body: bytes) -> tuple[bytes, bytes]:
    """A whole reply's length: the client reads no chunked framing, and the server writes head
    and body at once (zml_gateway.protocol.FastCycle)."""
    return (b"content-length", b"%d" % len(body))


def _without_body(send: Send) -> Send:
    """``send`` for a HEAD request: the response's head as for GET, its body bytes dropped."""
    async def head_only(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            message = {**message, "body": b""}
        await send(message)
    return head_only


_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


def _total_tokens(data: bytes) -> int:
    """Tokens a reply used (the last total_tokens: the routing metadata's), for plan limits."""
    found = _TOTAL_TOKENS.findall(data[-4096:])
    return int(found[-1]) if found else 0


def _broker_lost() -> ZMLError:
    return ZMLConnectionError("the broker connection was lost while the request was in flight; retry",
                              retry_after=0.5)



#: nats-py puts a status line (e.g. the broker's "503 no responders") in this header.
_NATS_STATUS = "Status"
_NO_RESPONDERS = "503"


class _ClientGone(Exception):
    """The HTTP client went away while its request ran (an Exchange abort)."""


class _BrokerLost(Exception):
    """The broker connection was lost while a request ran (an Exchange abort)."""


def _no_router() -> NoHealthyNodesError:
    return NoHealthyNodesError("no router is running (no responders on zml.gateway.infer)", retry_after=1.0)


class Gateway:
    def __init__(self, cfg: ZMLConfig, nc: NATS, nodes: dict[str, NodeState], costs: CostTable | None = None,
                 access: Access | None = None) -> None:
        self.cfg = cfg
        self.nc = nc
        self.nodes = nodes  # kept current by the service from the KV stream
        self.costs = costs or CostTable()
        self.timeout = cfg.defaults.request_timeout_s
        self.max_body = cfg.gateway.max_body_bytes
        self.in_flight = 0  # inference requests held now (bounded by [gateway] max_concurrent)
        self.access = access or Access(cfg, KeyRing(cfg.gateway.api_keys), None)
        self.owner = config_owner(cfg.nats)  # this gateway's NATS identity: its cancel subjects
        self.inflight = InFlight()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            allowed = _ROUTES.get(path) or ("GET" if path.startswith("/v1/models/") else None)
            if allowed is None:
                raise NotFoundError(f"no route {clip(path, 80)}: see /v1/chat/completions, /v1/completions, /v1/models")
            if method == "HEAD" and allowed == "GET":
                # HEAD is GET without the body (RFC 9110 9.3.2; load balancers probe /healthz so):
                # the same status and headers, content-length included, on HTTP/1.1 and HTTP/2.
                send = _without_body(send)
            elif method != allowed:
                raise MethodNotAllowedError(f"{clip(path, 80)} takes {allowed}, not {clip(method, 20)}")
            if allowed == "POST":
                return await self._infer(scope, receive, send)
            if path == "/healthz":
                ok = self.nc.is_connected
                return await self._plain(send, 200 if ok else 503, {"status": "ok" if ok else "nats_disconnected"})
            self.access.authenticate(scope)
            if path == "/v1/models":
                return await self._plain(send, 200, model_list(self.cfg, self.nodes))
            if path.startswith("/v1/models/"):
                return await self._plain(send, 200, model_object(self.cfg, self.nodes, path[len("/v1/models/"):]))
            return await self._plain(send, 200, {"nodes": await self._node_table()})
        except ZMLError as exc:
            await self._error(send, exc, scope)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not answer with a traceback: log it, answer INTERNAL
            log.exception("internal error on %s %s", method, clip(path, 80))
            await self._error(send, ZMLError("internal error in the gateway"), scope)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


    async def _node_table(self) -> list[dict[str, Any]]:
        """Health's view of every node, with run-time prices and the routers' view (in flight,
        cooldown, saturation) gathered from every replica for ~150 ms."""
        views: list[dict[str, Any]] = []
        inbox = self.nc.new_inbox()

        async def collect(msg: Any) -> None:
            try:
                views.append(msgspec.json.decode(msg.data))
            except msgspec.DecodeError:
                pass

        sub = await self.nc.subscribe(inbox, cb=collect)
        try:
            await self.nc.publish(subjects.ROUTERS_STATE, b"", reply=inbox)
            await asyncio.sleep(0.15)
        finally:
            await sub.unsubscribe()
        out = []
        for node_id in sorted(self.nodes):
            row: dict[str, Any] = msgspec.to_builtins(self.costs.apply(self.nodes[node_id]))
            row.setdefault("cost_per_hour", 0.0)  # omitted as a default, yet a free node's price
            seen = [v["nodes"][node_id] for v in views if node_id in v.get("nodes", {})]
            row["routers"] = len(seen)
            row["in_flight"] = max((r["outstanding"] for r in seen), default=0)
            row["cooldown_s"] = max((r["cooldown_s"] for r in seen), default=0.0)
            row["saturated_s"] = max((r["saturated_s"] for r in seen), default=0.0)
            out.append(row)
        return out

    # --- inference -------------------------------------------------------------------------
    def body_limit(self) -> int:
        """[gateway] max_body_bytes, or less when the NATS server's max_payload is smaller: a
        body the gateway accepts must fit in one NATS message."""
        payload = self.nc.max_payload or self.max_body
        return max(1, min(self.max_body, payload - _HEADER_ROOM))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.body_limit()
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    raise RequestTooLargeError(f"request body of {int(value)} bytes is over the limit of {limit} bytes")
                break
        if getattr(getattr(receive, "__self__", None), "body_complete", False):
            # All here already (zml_gateway.protocol.FastCycle: a small body comes with its
            # head): nothing to wait for, so no timer to arm and cancel.
            return await self._read_rest(receive, limit)
        timeout = self.cfg.gateway.body_timeout_s
        try:
            async with asyncio.timeout(timeout):  # a client that sends headers, then trickles or stalls
                return await self._read_rest(receive, limit)
        except asyncio.TimeoutError:
            slow = BadRequestError(f"request body not received within {timeout:g} s")
            slow.http_status = 408  # type: ignore[misc]  # like the header timeout: BAD_REQUEST, 408
            raise slow from None

    @staticmethod
    async def _read_rest(receive: Receive, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(f"request body larger than the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _infer(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = self.access.authenticate(scope)
        if self.in_flight >= self.cfg.gateway.max_concurrent:
            raise QueueFullError(f"this gateway holds {self.in_flight} requests, its limit: retry shortly",
                                 retry_after=1.0)
        self.in_flight += 1
        try:
            await self._infer_admitted(scope, receive, send, caller)
        finally:
            self.in_flight -= 1

    async def _infer_admitted(self, scope: Scope, receive: Receive, send: Send, caller: Caller) -> None:
        body = await self._read_body(scope, receive)
        d = self.cfg.defaults
        req = decode_request(body, max_depth=d.max_json_depth)
        request_id = check_request_id(req.request_id) if req.request_id else os.urandom(8).hex()
        timeout = request_timeout_s(req.timeout_ms, None, self.timeout, d.max_request_timeout_s)
        self.access.check_model(caller, req.model, self.cfg.resolve_model(req.model))
        try:
            limits = await self.access.admit(caller, request_id, timeout + 5.0)
        except RateLimited as exc:
            metrics.rate_limited(caller)
            await self._plain(send, 429, exc.error.to_body(), exc.headers)
            return
        tokens = [0]
        if caller.leased:  # a plan's slot: freed before the answer's last message goes out
            send = self._releasing(send, caller, request_id, tokens)
        try:
            # An id the caller's SDK made up (x-zml-id-generated) is unique like ours: no shared
            # claim needed. Set on its own ids, it only drops that check for this caller.
            generated = not req.request_id or (b"x-zml-id-generated", b"1") in scope["headers"]
            # The routers get the caller's bytes, ZML's own fields moved to headers (zmlcore.messages.frontdoor).
            body, fields = frontdoor.split(body, req)
            await self._dispatch(body, req.stream, request_id, timeout, receive, send, limits, caller, tokens,
                                 generated=generated, fields=fields)
        finally:  # before an error answer (sent by the caller of this): a no-op once released
            await self.access.release(caller, request_id, tokens[0])

    def _releasing(self, send: Send, caller: Caller, request_id: str, tokens: list[int]) -> Send:
        """``send`` that frees the caller's plan slot just before the last body message: a client
        that sends its next request on this answer never meets its own concurrency limit, on
        any gateway. Only for plan-limited callers (others keep the bare send)."""
        async def last_after_release(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await self.access.release(caller, request_id, tokens[0])
            await send(message)
        return last_after_release

    async def _dispatch(self, body: bytes, stream: bool, request_id: str, timeout: float, receive: Receive,
                        send: Send, limits: list[tuple[bytes, bytes]], caller: Caller, tokens: list[int],
                        generated: bool = False, fields: dict[str, str] | None = None) -> None:
        headers = {subjects.H_REQUEST_ID: request_id, subjects.H_TIMEOUT_MS: str(int(timeout * 1000))}
        if fields:
            headers.update(fields)
        # The routing metadata once, in the reply body: the HTTP headers are made from it here.
        headers[subjects.H_ACCEPT_ROUTING] = subjects.ROUTING_IN_BODY
        if generated:  # unique by construction: routers skip the cross-replica duplicate check
            headers[subjects.H_ID_GENERATED] = "1"
        if caller.record is not None:  # the key's options travel with the request
            if caller.record.default_policy:
                headers[subjects.H_DEFAULT_POLICY] = caller.record.default_policy
            if caller.record.label:
                headers[subjects.H_LABEL] = caller.record.label
        if tracing.ON:  # the router's span continues the gateway's
            gateway_tracing.forward(headers)
        if not self.nc.is_connected:
            left = await self._await_broker(timeout)
            headers[subjects.H_TIMEOUT_MS] = str(max(1, int(left * 1000)))
        owned = self.inflight.claim(caller.identity, request_id, headers)
        try:
            if stream:
                await self._infer_stream(body, headers, request_id, timeout, receive, send, limits, tokens)
            else:
                await self._infer_once(body, headers, request_id, timeout, receive, send, limits, tokens)
        finally:
            self.inflight.release(owned)

    async def _await_broker(self, timeout: float) -> float:
        """A request that arrives while the broker connection is down has reached nobody, so it
        waits for the reconnect (a broker restart takes well under a second) within [gateway]
        no_router_grace_s and never past its own timeout, then goes on with the time left.
        Past that: 503 CONNECTION_FAILED, as before. It is not published while disconnected:
        nats-py would buffer it, and a buffer lost with the connection would lose it silently."""
        t0 = time.monotonic()
        grace = min(self.cfg.gateway.no_router_grace_s, timeout)
        link = link_of(self.nc)
        if grace > 0:
            try:
                async with asyncio.timeout(grace):
                    while not self.nc.is_connected and not link.closed.is_set():
                        await link.reconnected(link.generation)
            except asyncio.TimeoutError:  # the builtin (zmlcore's TimeoutError is imported here)
                pass
        if not self.nc.is_connected:
            raise ZMLConnectionError("the gateway has lost its broker connection; retry", retry_after=1.0)
        return timeout - (time.monotonic() - t0)

    async def _cancel(self, request_id: str, headers: dict[str, str]) -> None:
        await publish(self.nc, subjects.cancel(request_id, self.owner), b"",
                                headers={subjects.H_OWNER: headers[subjects.H_OWNER]})

    def _exchange(self, body: bytes, headers: dict[str, str], timeout: float, buffer: int | None = None) -> Exchange:
        """The request to the routers: keepalives asked for, a dead router's request sent again
        (and one that found no router, within [gateway] no_router_grace_s: zmlcore.reply.norouter);
        a plain reply over max_payload collected in parts (``buffer`` None: room for all of them)."""
        ka = self.cfg.gateway.router_keepalive_ms
        limit = self.cfg.nats.max_reply_bytes
        return Exchange(self.nc, body, headers, timeout_s=timeout, wait_s=timeout + 1.0, subject=subjects.FRONT_DOOR_INFER,
                        keepalive_s=ka / 1000.0 if ka else None, accept_parts=None if buffer else limit,
                        buffer=buffer or parts_buffer(limit, self.nc.max_payload),
                        no_router_grace_s=self.cfg.gateway.no_router_grace_s)

    def _watch(self, ex: Exchange, receive: Receive) -> Callable[[], None]:
        """While a request runs, the HTTP client going away and the broker connection being
        lost both abort its exchange: the broker is a callback; the client is one too when the
        server offers it (zml_gateway.protocol.FastCycle.on_disconnect, HTTP/1.1), else a task
        waits on ``receive()``. Returns what stops watching."""
        unwatch = link_of(self.nc).on_change(lambda: ex.abort(_BrokerLost()))
        on_disconnect = getattr(getattr(receive, "__self__", None), "on_disconnect", None)
        if on_disconnect is not None:  # no task (created, run, cancelled) per request
            off = on_disconnect(lambda: ex.abort(_ClientGone()))

            def stop_hook() -> None:
                off()
                unwatch()
            return stop_hook

        async def client_gone() -> None:
            try:
                await receive()  # the body was read whole: what comes next is the disconnect
            except Exception:
                pass
            ex.abort(_ClientGone())

        task = asyncio.ensure_future(client_gone())

        def stop() -> None:
            task.cancel()
            unwatch()
        return stop

    async def _infer_once(self, body: bytes, headers: dict[str, str], request_id: str, timeout: float,
                          receive: Receive, send: Send, limits: list[tuple[bytes, bytes]], tokens: list[int]) -> None:
        ex = self._exchange(body, headers, timeout)
        await ex.send()
        # The client going away cancels the request on the node; a reply sent while the broker
        # was away is lost: neither waits the whole timeout.
        stop = self._watch(ex, receive)
        try:
            reply = await ex.reply()
        except _ClientGone:
            await self._cancel(request_id, headers)
            return
        except _BrokerLost:
            await self._cancel(request_id, headers)
            raise _broker_lost() from None
        except ZMLError:  # TIMEOUT, or its router gone (and gone again after a resend)
            await self._cancel(request_id, headers)
            raise
        finally:
            stop()
            ex.close()
        rh = reply.headers or {}
        if rh.get(_NATS_STATUS) == _NO_RESPONDERS and not reply.data:
            raise _no_router()
        code = rh.get(subjects.H_ERROR_CODE)
        if code is not None:
            await self._relay_error(send, code, reply.data, rh.get(subjects.H_RETRY_AFTER), limits)
            return
        data = reply.data
        info = routingmeta.from_body(data)  # asked for in the body only (Zml-Accept-Routing)
        if info is not None:
            out = [_JSON, _length(data), *limits, *routingmeta.http_headers_of(info)]
            tokens[0] = info.total_tokens or 0
        else:
            out = [_JSON, _length(data), *limits, *routingmeta.http_headers(rh)]
            tokens[0] = _total_tokens(data)
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": data})

    async def _infer_stream(
        self, body: bytes, headers: dict[str, str], request_id: str, timeout: float, receive: Receive, send: Send,
        limits: list[tuple[bytes, bytes]], tokens: list[int],
    ) -> None:
        # Chunks wait in a bounded buffer while the HTTP client is slow to read (overflow: cancel).
        # SSE relayed as the node framed it, chunks as header-less frames (zmlcore.reply.streamframe).
        headers[subjects.H_ACCEPT_STREAM] = subjects.STREAM_FRAMES
        ex = self._exchange(body, headers, timeout, self.cfg.gateway.stream_buffer)
        stop = self._watch(ex, receive)
        started = False
        seq = SeqCheck()  # a lost message ends the stream with an error, never silently short
        try:
            await ex.send()
            while True:
                try:
                    msg = await ex.next()  # TIMEOUT past the request's timeout (+1 s grace)
                except _ClientGone:
                    await self._cancel(request_id, headers)
                    return
                except _BrokerLost:  # chunks sent while the broker was away are lost
                    await self._cancel(request_id, headers)
                    if started:
                        await self._sse_error(send, StreamInterruptedError(
                            "the broker connection was lost mid-stream; the stream is incomplete").to_body())
                        return
                    raise _broker_lost() from None
                except ZMLError as exc:  # its router gone (STREAM_INTERRUPTED once relaying), or TIMEOUT
                    await self._cancel(request_id, headers)
                    if started:
                        await self._sse_error(send, exc.to_body())
                        return
                    raise
                if ex.overflowed:
                    await self._cancel(request_id, headers)
                    slow = BackendError(f"client read too slowly: more than {ex.buffer} chunks waiting; "
                                        "request cancelled")
                    if started:
                        await self._sse_error(send, slow.to_body())
                        return
                    raise slow
                if msg.headers is None:  # a frame: events, written with any that queued up behind it
                    body, lost = streamframe.collect(msg.data, ex.next_frame, seq)
                    if body:
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    if lost is None:
                        continue
                    await self._cancel(request_id, headers)
                    if not started:
                        raise lost
                    await self._sse_error(send, lost.to_body())
                    return
                mh = msg.headers
                if mh.get(_NATS_STATUS) == _NO_RESPONDERS and not msg.data:
                    # The broker's "no responders" status (routers not re-subscribed yet after a
                    # restart): a clean retryable error, not an empty 500.
                    gone = _no_router()
                    if not started:
                        raise gone
                    await self._sse_error(send, gone.to_body())
                    return
                kind = mh.get(subjects.H_STREAM)
                gap = seq.gap(mh.get(subjects.H_SEQ)) if kind in _SEQUENCED else None
                if gap is not None:
                    await self._cancel(request_id, headers)
                    lost = StreamInterruptedError(f"{gap}; the stream is incomplete")
                    if not started:
                        raise lost
                    await self._sse_error(send, lost.to_body())
                    return
                if kind == subjects.STREAM_EVENTS:  # whole SSE events, relayed as the node framed them
                    await send({"type": "http.response.body", "body": msg.data, "more_body": True})
                elif kind == subjects.STREAM_CHUNK:
                    await send({"type": "http.response.body", "body": b"data: " + msg.data + b"\n\n", "more_body": True})
                elif kind == "start":
                    info = None if subjects.H_NODE_ID in mh else routingmeta.from_start(msg.data)
                    routing = routingmeta.http_headers_of(info) if info is not None else routingmeta.http_headers(mh)
                    out = [*_SSE_HEADERS, *limits, *routing]
                    await send({"type": "http.response.start", "status": 200, "headers": out})
                    started = True
                elif kind == subjects.STREAM_END:
                    tokens[0] = _total_tokens(msg.data)
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                    return
                else:  # error (or a non-stream reply from a router that ignored stream)
                    code = mh.get(subjects.H_ERROR_CODE, "INTERNAL")
                    if not started:
                        await self._relay_error(send, code, msg.data, mh.get(subjects.H_RETRY_AFTER), limits)
                    else:
                        await send({"type": "http.response.body", "body": b"data: " + msg.data + b"\n\n"})
                    return
        finally:
            stop()
            ex.close()

    async def _sse_error(self, send: Send, body: Any) -> None:
        await send({"type": "http.response.body", "body": b"data: " + _encode(body) + b"\n\n"})

    # --- responses -------------------------------------------------------------------------
    async def _plain(self, send: Send, status: int, payload: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        body = _encode(payload)
        await send({"type": "http.response.start", "status": status, "headers": [_JSON, _length(body), *(extra or [])]})
        await send({"type": "http.response.body", "body": body})

    async def _error(self, send: Send, exc: ZMLError, scope: Scope | None = None) -> None:
        extra = []
        if exc.http_status == 405 and scope is not None:
            extra.append((b"allow", _ROUTES.get(scope["path"], "GET").encode()))
        if exc.retry_after is not None:
            extra.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
        if exc.http_status == 408:  # a body cut off: its rest would be read as a next request
            extra.append((b"connection", b"close"))
        await self._plain(send, exc.http_status, exc.to_body(), extra)

    async def _relay_error(self, send: Send, code: str, data: bytes, retry_after: str | None = None,
                           limits: list[tuple[bytes, bytes]] | None = None) -> None:
        cls = error_class(code)
        if not data:  # never an empty error body: say what the code means
            data = _encode(cls(f"{code} from the router").to_body())
        extra = list(limits or ())
        if retry_after is not None:  # HTTP wants whole seconds
            extra.append((b"retry-after", str(max(1, math.ceil(float(retry_after)))).encode()))
        await send({"type": "http.response.start", "status": cls.http_status, "headers": [_JSON, _length(data), *extra]})
        await send({"type": "http.response.body", "body": data})
