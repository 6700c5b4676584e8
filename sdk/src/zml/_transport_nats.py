"""NATS transports: straight to the routers by request-reply on ``zml.infer`` (no gateway).

:class:`AsyncNatsTransport` is the real one. :class:`SyncNatsTransport` is the one bridge of
the SDK: nats-py is asyncio-only, so the sync client runs the async transport on a private
event-loop thread. Cancelling (closing a stream, a timeout, Ctrl-C) publishes on
``zml.cancel.<owner>.<request_id>`` so the router aborts the call on the node. nats exceptions
become ZML errors here and nowhere else.

The identity (nkey seed, env ZML_NATS_NKEY or ``[nats] nkey_file``) and TLS come from the
configuration: with an identity, replies arrive on the identity's own inbox prefix and the
owner in cancel subjects is its public key (see docs/security.md).

Inference goes through :class:`zmlcore.reply.exchange.Exchange`: the transport asks the routers for
keepalives, and a request whose router dies (3 silent intervals) is sent once more to another
router, invisibly; a stream that had started is continued by that router from the text
received (zmlcore.reply.resume), numbering on, so the caller reads one stream.
A request that finds no router subscribed (the broker's "no responders": for a moment after a
broker restart, or while routers restart) reached nobody, so it is sent again after a short
backoff for up to ``no_router_grace_s`` (:mod:`zmlcore.reply.norouter`) before NO_HEALTHY_NODES.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from zml._core import (
    InferCall,
    RawReply,
    StreamEvent,
    decode_nats_frame,
    decode_nats_stream,
    lower_headers,
    nats_status,
    no_router_error,
    timeout_error,
)
from zml._errors import AuthError, ConnectionError, StreamInterruptedError, ZMLError
from zmlcore import subjects
from zmlcore.config import NatsConfig
from zmlcore.reply.exchange import Exchange, parts_buffer
from zmlcore.access.identity import connect_options, owner_of
from zmlcore.bus.connect import connect
from zmlcore.bus.link import link_of
from zmlcore.reply.norouter import NoRouterWait
from zmlcore.reply.parts import Reply
from zmlcore.reply.streamseq import SeqCheck
from zmlcore.bus.publish import flush

__all__ = ["AsyncNatsStream", "AsyncNatsTransport", "SyncNatsStream", "SyncNatsTransport"]

T = TypeVar("T")

#: Keepalive interval asked of the routers (``Zml-Keepalive``): a dead router is noticed after
#: three of them. None turns keepalives (and so router failover) off.
ROUTER_KEEPALIVE_S: float | None = 1.0
#: How long a request waits for a router when none is subscribed (as the gateway's
#: ``[gateway] no_router_grace_s``); never past the request's own timeout. 0: fail at once.
NO_ROUTER_GRACE_S = 2.0
#: How long the connection tries to come back when the broker goes away (a restart: a blink of
#: a few seconds): requests in flight are sent again when it is back, new ones wait for it
#: (as the gateway's ``[gateway] broker_grace_s``). Past it the connection closes: CONNECTION_FAILED.
BROKER_GRACE_S = 10.0
RECONNECT_WAIT_S = 0.2


def _reply(msg: Msg | Reply) -> RawReply:
    headers = lower_headers(msg.headers)
    return RawReply(status=nats_status(headers), headers=headers, body=msg.data)


class AsyncNatsTransport:
    def __init__(self, url: str, timeout: float, connect_timeout: float = 2.0, nats_config: NatsConfig | None = None,
                 keepalive_s: float | None = ROUTER_KEEPALIVE_S, no_router_grace_s: float | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self.keepalive_s = keepalive_s
        self.no_router_grace_s = NO_ROUTER_GRACE_S if no_router_grace_s is None else no_router_grace_s
        self.connect_timeout = connect_timeout
        nats_config = nats_config or NatsConfig(url=url)
        self._options = connect_options(nats_config)
        #: Largest reply collected in parts (replies over max_payload: zmlcore.reply.bigreply).
        self.max_reply_bytes = nats_config.max_reply_bytes
        self.owner = owner_of(self._options)
        self._nc: NATS | None = None
        self._lock: asyncio.Lock | None = None
        #: The server's last "permissions violation" message (a subject this identity may not use).
        self._denied = ""

    async def _conn(self) -> NATS:
        if self._nc is not None and self._nc.is_connected:
            return self._nc
        if self._nc is not None and self._nc.is_reconnecting:  # a broker blink: wait for it (bounded)
            link = link_of(self._nc)
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(BROKER_GRACE_S):
                    while self._nc.is_reconnecting:
                        await link.reconnected(link.generation)
            if self._nc.is_connected:
                return self._nc
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._nc is not None and self._nc.is_connected:
                return self._nc

            async def _quiet(exc: Exception) -> None:  # nats-py logs every error otherwise
                if "permissions violation" in str(exc).lower() or "authorization violation" in str(exc).lower():
                    self._denied = str(exc)

            # A refused identity or TLS setting raises AuthError / ConfigError at once with the
            # line saying what to set; an unreachable server ConnectionError within the timeout.
            try:
                self._nc = await connect(
                    self.url,  # one URL or several (the servers of one cluster), comma-separated
                    "zml-sdk",
                    connect_timeout=self.connect_timeout,
                    give_up_s=self.connect_timeout,
                    max_reconnect_attempts=int(BROKER_GRACE_S / RECONNECT_WAIT_S),
                    reconnect_time_wait=RECONNECT_WAIT_S,
                    on_error=_quiet,
                    quiet=True,
                    **self._options,
                )
            except ConnectionError as exc:
                raise ConnectionError(f"{exc.message}. Is `zml up` running? Check --endpoint / ZML_ENDPOINT.") from exc
            return self._nc

    async def request(self, subject: str, body: bytes, headers: dict[str, str] | None, timeout_s: float) -> RawReply:
        """One request-reply (admin subjects; inference goes through :meth:`infer`)."""
        nc = await self._conn()
        wait = NoRouterWait(self.no_router_grace_s)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    msg = await nc.request(subject, body, timeout=max(0.001, deadline - time.monotonic()),
                                           headers=headers)
                    break
                except nats.errors.NoRespondersError:
                    delay = wait.delay(time.monotonic(), deadline)  # nobody got it: safe to ask again
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
        except nats.errors.NoRespondersError as exc:
            raise no_router_error(subject) from exc
        except nats.errors.TimeoutError as exc:
            if f'"{subject.lower()}"' in self._denied.lower():  # no reply because the server refused the publish
                raise AuthError(f"this NATS identity may not use {subject} ({self._denied}); "
                                "see docs/security.md for what each role may do") from exc
            raise timeout_error(timeout_s, (headers or {}).get(subjects.H_REQUEST_ID, "-")) from exc
        except (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, OSError) as exc:
            raise ConnectionError(f"NATS connection to {self.url} lost: {exc}") from exc
        return _reply(msg)

    async def cancel(self, request_id: str) -> None:
        if self._nc is None:  # never connected: the request was not sent
            return
        with contextlib.suppress(Exception):
            nc = await self._conn()
            await nc.publish(subjects.cancel(request_id, self.owner), b"")
            await flush(nc, 1)

    def _exchange(self, nc: NATS, call: InferCall, buffer: int | None) -> Exchange:
        """``buffer`` None: a plain reply, collected in parts when over max_payload."""
        headers = call.nats_headers()
        return Exchange(nc, call.encode(), headers, timeout_s=int(headers[subjects.H_TIMEOUT_MS]) / 1000.0,
                        wait_s=call.timeout_s, keepalive_s=self.keepalive_s, no_router_grace_s=self.no_router_grace_s,
                        accept_parts=None if buffer else self.max_reply_bytes,
                        buffer=buffer or parts_buffer(self.max_reply_bytes, nc.max_payload),
                        resume=bool(buffer))  # a stream: continued by another router if its own dies

    async def _send(self, call: InferCall, buffer: int | None) -> Exchange:
        nc = await self._conn()
        ex = self._exchange(nc, call, buffer)
        # A broker blink sends it again when the connection is back; a close for good ends it.
        ex.follow(link_of(nc), lambda: ConnectionError(f"NATS connection to {self.url} closed"))
        try:
            await ex.send()
        except (nats.errors.Error, OSError) as exc:
            ex.close()
            raise ConnectionError(f"NATS connection to {self.url} lost: {exc}") from exc
        return ex

    async def _infer_once(self, call: InferCall) -> RawReply:
        ex = await self._send(call, None)
        try:
            reply = await ex.reply()
        except (nats.errors.ConnectionClosedError, OSError) as exc:
            raise ConnectionError(f"NATS connection to {self.url} lost: {exc}") from exc
        except ZMLError as exc:
            if f'"{subjects.INFER}"' in self._denied.lower():  # silence because the server refused the publish
                raise AuthError(f"this NATS identity may not use {subjects.INFER} ({self._denied}); "
                                "see docs/security.md for what each role may do") from exc
            if exc.code == "TIMEOUT":  # the SDK's own wording (request id, what to change)
                raise timeout_error(call.timeout_s, call.request_id) from None
            raise
        finally:
            ex.close()
        if lower_headers(reply.headers).get("status") == "503" and not reply.data:
            raise no_router_error(subjects.INFER)
        return _reply(reply)

    async def infer(self, call: InferCall) -> RawReply:
        try:
            return await self._infer_once(call)
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel(call.request_id))
            raise
        except ZMLError as exc:
            if exc.code == "TIMEOUT":
                await self.cancel(call.request_id)
            raise

    async def nodes(self) -> RawReply:
        return await self.request(subjects.admin_nodes("list"), b"", None, self.timeout)

    async def models(self) -> RawReply:
        nodes = await self.nodes()
        return nodes  # the CLI derives models from the node list over NATS

    async def open_stream(self, call: InferCall) -> AsyncNatsStream:
        # Generous: a stream's chunks wait here until the caller iterates (the router does not
        # wait for a slow reader; overflow ends the stream with an error).
        return AsyncNatsStream(self, await self._send(call, 65536), call)

    async def aclose(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()
            self._nc = None


class AsyncNatsStream:
    """Stream events of one streamed reply; ``aclose()`` before the end cancels the request."""

    def __init__(self, transport: AsyncNatsTransport, ex: Exchange, call: InferCall) -> None:
        self._t = transport
        self._ex = ex
        self._call = call
        self._finished = False
        self.headers: dict[str, str] = {}

    async def events(self) -> AsyncIterator[StreamEvent]:
        seq = SeqCheck()  # a lost message ends the stream with an error, never silently short
        while True:
            try:
                msg = await self._ex.next()
            except ZMLError as exc:  # TIMEOUT, or its router gone (STREAM_INTERRUPTED once started)
                if exc.code == "TIMEOUT":
                    exc = timeout_error(self._call.timeout_s, self._call.request_id)
                yield StreamEvent("error", error=exc)
                return
            except (nats.errors.ConnectionClosedError, OSError) as exc:
                raise ConnectionError(f"NATS connection to {self._t.url} lost: {exc}") from exc
            if self._ex.overflowed:
                yield StreamEvent("error", error=StreamInterruptedError(
                    "more stream messages arrived than the client buffers while it was not reading; "
                    "the stream is incomplete", retry_after=1.0))
                return
            if not msg.headers:  # a chunk frame (asked for: InferCall.nats_headers)
                for ev in decode_nats_frame(msg.data, seq):
                    if ev.kind == "error" and ev.error is not None and ev.error.code == "STREAM_INTERRUPTED" \
                            and await self._ex.continue_lost():
                        break  # a router continues it from what came before the lost message
                    yield ev
                    if ev.kind == "error":  # left unfinished: closing the stream cancels the request
                        return
                continue
            headers = lower_headers(msg.headers)
            if headers.get("status") == "503":
                self._finished = True
                yield StreamEvent("error", error=no_router_error())
                return
            ev = decode_nats_stream(headers, msg.data)
            gap = seq.gap(headers.get(subjects.H_SEQ.lower())) if ev.kind != "error" else None
            if gap is not None and ev.kind != "start" and await self._ex.continue_lost():
                continue  # a router continues it from what came before the lost message
            if gap is not None:  # left unfinished: closing the stream cancels the request
                yield StreamEvent("error", error=StreamInterruptedError(f"{gap}; the stream is incomplete"))
                return
            if ev.kind in ("end", "error"):
                self._finished = True
            yield ev
            if self._finished:
                return

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            await self._t.cancel(self._call.request_id)
        self._ex.close()


class SyncNatsTransport:
    """The async transport driven from a private event-loop thread (the SDK's only bridge)."""

    def __init__(self, url: str, timeout: float, connect_timeout: float = 2.0, nats_config: NatsConfig | None = None,
                 keepalive_s: float | None = ROUTER_KEEPALIVE_S, no_router_grace_s: float | None = None) -> None:
        self.url = url
        # checks the identity first
        self._async = AsyncNatsTransport(url, timeout, connect_timeout, nats_config, keepalive_s, no_router_grace_s)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zml-nats", daemon=True)
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        finished = threading.Event()

        async def run() -> T:
            try:
                return await coro
            finally:
                finished.set()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result()
        except BaseException:
            # KeyboardInterrupt or similar in the caller: cancel the coroutine (and the request),
            # and wait until it has cleaned up (the future says "cancelled" at once, before that).
            if not fut.done():
                fut.cancel()
                finished.wait(2)
            raise

    def infer(self, call: InferCall) -> RawReply:
        return self._run(self._async.infer(call))

    def nodes(self) -> RawReply:
        return self._run(self._async.nodes())

    def models(self) -> RawReply:
        return self._run(self._async.models())

    def open_stream(self, call: InferCall) -> SyncNatsStream:
        return SyncNatsStream(self, self._run(self._async.open_stream(call)))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._run(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


class SyncNatsStream:
    def __init__(self, bridge: SyncNatsTransport, stream: AsyncNatsStream) -> None:
        self._bridge = bridge
        self._stream = stream
        self._events = stream.events()
        self.headers: dict[str, str] = {}

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            try:
                ev = self._bridge._run(self._next())
            except StopAsyncIteration:
                return
            yield ev

    async def _next(self) -> StreamEvent:
        return await self._events.__anext__()

    def close(self) -> None:
        async def _close() -> None:
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            await self._stream.aclose()

        if not self._bridge._loop.is_closed():
            self._bridge._run(_close())
