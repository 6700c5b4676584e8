"""Intake of an inference request, before it costs a NATS message: the body read within its
bounds (size, time), checked with the router's own rules (zmlcore.messages.validate), and
turned into what goes to the routers: the caller's bytes with ZML's own fields moved to NATS
headers (zmlcore.messages.frontdoor)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import BadRequestError, RequestTooLargeError
from zmlcore.messages import InferRequest, frontdoor
from zmlcore.messages.validate import check_request_id, decode_request, request_timeout_s
from zmlcore.policy.prefix.keys import chain_header, keyed, request_keys
from zmlcore.telemetry import tracing
from zml_gateway import observe
from zml_gateway.access import Access, Caller
from zml_gateway.asgi import Receive, Scope



@dataclass(slots=True)
class Checked:
    """A request body that passed the checks."""

    req: InferRequest
    request_id: str  # the caller's, or one made here
    timeout: float  # seconds, capped by [defaults] max_request_timeout_s
    model: str  # the canonical name of ``req.model`` (an alias resolved once)


class Intake:
    def __init__(self, cfg: ZMLConfig, nc: NATS, access: Access) -> None:
        self.cfg = cfg
        self.nc = nc
        self.access = access

    def body_limit(self) -> int:
        """[gateway] max_body_bytes. A body larger than one NATS message goes to its router in
        parts, as audio does (zmlcore.reply.exchange, zml_router.request.uploads)."""
        return self.cfg.gateway.max_body_bytes

    async def read_body(self, scope: Scope, receive: Receive, limit: int | None = None, what: str = "") -> bytes:
        """The whole body, at most ``limit`` bytes (default :meth:`body_limit`; ``what`` names the
        setting in the 413), within ``[gateway] body_timeout_s``."""
        if not limit:
            limit, what = self.body_limit(), " ([gateway] max_body_bytes)"
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > limit:
                    raise RequestTooLargeError(f"request body of {int(value)} bytes is over the limit of {limit} "
                                               f"bytes{what}")
                break
        if getattr(getattr(receive, "__self__", None), "body_complete", False):
            # All here already (zml_gateway.protocol.FastCycle: a small body comes with its
            # head): nothing to wait for, so no timer to arm and cancel.
            return await _read_rest(receive, limit, what)
        timeout = self.cfg.gateway.body_timeout_s
        try:
            async with asyncio.timeout(timeout):  # a client that sends headers, then trickles or stalls
                return await _read_rest(receive, limit, what)
        except asyncio.TimeoutError:
            slow = BadRequestError(f"request body not received within {timeout:g} s")
            slow.http_status = 408  # type: ignore[misc]  # like the header timeout: BAD_REQUEST, 408
            raise slow from None

    def check(self, body: bytes, caller: Caller) -> Checked:
        """Decode and validate ``body``; the caller's key may use its model (403 if not)."""
        d = self.cfg.defaults
        req = decode_request(body, max_depth=d.max_json_depth)
        request_id = check_request_id(req.request_id) if req.request_id else os.urandom(8).hex()
        timeout = request_timeout_s(req.timeout_ms, None, d.request_timeout_s, d.max_request_timeout_s)
        model = self.cfg.resolve_model(req.model)
        self.access.check_model(caller, req.model, model)
        return Checked(req, request_id, timeout, model)

    @staticmethod
    def outbound(body: bytes, checked: Checked, scope: Scope, caller: Caller) -> tuple[bytes, dict[str, str]]:
        """The body and NATS headers the routers get: the caller's bytes, ZML's own fields moved
        to headers, the prompt's key chain, the key's options, the trace context."""
        req = checked.req
        # An id the caller's SDK made up (x-zml-id-generated) is unique like ours: no shared
        # claim needed. Set on its own ids, it only drops that check for this caller.
        generated = not req.request_id or (b"x-zml-id-generated", b"1") in scope["headers"]
        body, fields = frontdoor.split(body, req)
        headers = {subjects.H_REQUEST_ID: checked.request_id, subjects.H_TIMEOUT_MS: str(int(checked.timeout * 1000))}
        headers.update(fields)
        # A prompt the router would key (zml_router.request.prepare.prefix_chain) is keyed here, where it
        # was decoded to be checked: the router, which gets it raw (frontdoor), then need not
        # decode it again (~9 us at 8k tokens).
        if keyed(len(body), req.input is not None):
            chain = request_keys(checked.model, req.messages, req.prompt)
            if chain is not None:
                headers[subjects.H_PREFIX_KEYS] = chain_header(chain, checked.model)
        # The routing metadata once, in the reply body: the HTTP headers are made from it here.
        headers[subjects.H_ACCEPT_ROUTING] = subjects.ROUTING_IN_BODY
        return body, caller_headers(headers, generated, scope, caller)


def caller_headers(headers: dict[str, str], generated: bool, scope: Scope, caller: Caller) -> dict[str, str]:
    """``headers`` with what every request of this caller carries to the routers: its session,
    its key's options, the trace context, and that its id is unique (``generated``)."""
    if generated:  # unique by construction: routers skip the cross-replica duplicate check
        headers[subjects.H_ID_GENERATED] = "1"
    for name, value in scope["headers"]:
        if name == b"x-session-id":  # keep a conversation on the node that holds its prefix
            session = value[:subjects.MAX_SESSION_ID].decode("latin-1").strip()
            if session.isprintable() and session:
                headers[subjects.H_SESSION] = session
        else:
            flow = FLOW_HEADERS.get(name)
            if flow is not None:  # band and latency targets: the router reads and checks them
                headers[flow] = value[:64].decode("latin-1").strip()
    record = caller.record
    if record is not None:  # the key's options travel with the request
        if record.default_policy:
            headers[subjects.H_DEFAULT_POLICY] = record.default_policy
        if record.label:
            headers[subjects.H_LABEL] = record.label
        if record.priority:
            headers[subjects.H_PRIORITY_DEFAULT] = record.priority
        if record.max_priority:
            headers[subjects.H_PRIORITY_MAX] = record.max_priority
        if record.weight != 1.0:
            headers[subjects.H_TENANT_WEIGHT] = f"{record.weight:g}"
    if tracing.ON:  # the router's span continues the gateway's
        observe.forward(headers)
    return headers


#: HTTP request headers of flow control (docs/http-api.md) -> the NATS headers the router reads.
FLOW_HEADERS = {b"x-zml-priority": subjects.H_PRIORITY, b"x-zml-ttft-slo-ms": subjects.H_TTFT_SLO_MS,
                b"x-zml-tpot-slo-ms": subjects.H_TPOT_SLO_MS}


async def _read_rest(receive: Receive, limit: int, what: str) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLargeError(f"request body larger than the limit of {limit} bytes{what}")
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
