"""POST /v1/chat/completions, /v1/completions and /v1/embeddings: one request's way through
the gateway, in order (each step can end it with its error answer):

authenticate -> this gateway's concurrency bound -> read and check the body (intake) -> the
caller's plan (429) -> headers for the routers -> a broker that is reconnecting waited for ->
the request id claimed for this caller (409) -> one whole reply (once) or a stream (stream).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from zmlcore.config import ZMLConfig
from zmlcore.errors import QueueFullError
from zmlcore.runtime.bytebudget import ByteBudget
from zml_gateway import metrics
from zml_gateway.access import Access, Caller, RateLimited
from zml_gateway.asgi import Message, Receive, Scope, Send, send_json
from zml_gateway.infer.intake import Checked, Intake
from zml_gateway.infer.once import answer_once
from zml_gateway.infer.stream import relay_stream
from zml_gateway.infer.upstream import Outbound, Upstream
from zml_gateway.owners import InFlight
from zmlcore import subjects


#: The steps of one kind of request once authenticated and counted (:meth:`Inference.serve`).
Admitted = Callable[[Scope, Receive, Send, Caller], Awaitable[None]]


class Inference:
    def __init__(self, cfg: ZMLConfig, intake: Intake, access: Access, upstream: Upstream) -> None:
        self.cfg = cfg
        self.intake = intake
        self.access = access
        self.upstream = upstream
        self.in_flight = 0  # inference requests held now (bounded by [gateway] max_concurrent)
        #: Audio bytes this process holds now ([defaults] audio_bytes_in_flight: zml_gateway.infer.audio).
        self.audio_bytes = ByteBudget(cfg.defaults.audio_bytes_in_flight)
        self.claims = InFlight()  # request ids in flight, per caller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(scope, receive, send, self._json)

    async def serve(self, scope: Scope, receive: Receive, send: Send, admitted: Admitted) -> None:
        """Authenticate, hold a place in ``[gateway] max_concurrent``, then ``admitted``: the
        steps of one kind of request (JSON here, audio: zml_gateway.infer.audio)."""
        caller = await self.access.authenticate(scope)
        if self.in_flight >= self.cfg.gateway.max_concurrent:
            raise QueueFullError(f"this gateway holds {self.in_flight} requests, its limit: retry shortly",
                                 retry_after=1.0)
        self.in_flight += 1
        try:
            await admitted(scope, receive, send, caller)
        finally:
            self.in_flight -= 1

    async def _json(self, scope: Scope, receive: Receive, send: Send, caller: Caller) -> None:
        body = await self.intake.read_body(scope, receive)
        checked = self.intake.check(body, caller)
        await self.run(checked, lambda: self.intake.outbound(body, checked, scope, caller), caller, receive, send)

    async def run(self, checked: Checked, outbound: Callable[[], tuple[bytes, dict[str, str]]], caller: Caller,
                  receive: Receive, send: Send) -> None:
        """A checked request from the caller's plan on: ``outbound()`` makes what goes to the
        routers (body, headers) once the plan admitted it."""
        request_id = checked.request_id
        try:
            limits = await self.access.admit(caller, request_id, checked.timeout + 5.0)
        except RateLimited as exc:
            metrics.rate_limited(caller)
            await send_json(send, 429, exc.error.to_body(), exc.headers)
            return
        out = Outbound(b"", {}, request_id, checked.timeout, limits)
        if caller.leased:  # a plan's slot: freed before the answer's last message goes out
            send = self._releasing(send, caller, out)
        try:
            out.body, out.headers = outbound()
            await self._dispatch(out, checked.req.stream, caller, receive, send)
        finally:  # before an error answer (sent by the caller of this): a no-op once released
            await self.access.release(caller, request_id, out.tokens)

    def _releasing(self, send: Send, caller: Caller, out: Outbound) -> Send:
        """``send`` that frees the caller's plan slot just before the last body message: a client
        that sends its next request on this answer never meets its own concurrency limit, on
        any gateway. Only for plan-limited callers (others keep the bare send)."""
        async def last_after_release(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await self.access.release(caller, out.request_id, out.tokens)
            await send(message)
        return last_after_release

    async def _dispatch(self, out: Outbound, stream: bool, caller: Caller, receive: Receive, send: Send) -> None:
        if not self.upstream.nc.is_connected:
            left = await self.upstream.await_broker(out.timeout)
            out.headers[subjects.H_TIMEOUT_MS] = str(max(1, int(left * 1000)))
        owned = self.claims.claim(caller.identity, out.request_id, out.headers)
        try:
            if stream:
                await relay_stream(self.upstream, out, self.cfg.gateway.stream_buffer, receive, send)
            else:
                await answer_once(self.upstream, out, receive, send)
        finally:
            self.claims.release(owned)
