"""One attempt on one node, and the requester's answer: the HTTP call with the body the node
gets (zml_router.nodebody), and the reply relayed over NATS
(one message, or start / chunk... / end). Counts the attempt in flight while it runs.

An attempt that fails raises :class:`~zml_router.dispatch.AttemptError`; the request flow
(``zml_router.flow``) decides what follows.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from zmlcore import subjects
from zmlcore.reply import routingmeta
from zmlcore.reply import streamframe
from zmlcore.reply.bigreply import accepted
from zmlcore.messages import InferRequest, RoutingInfo, StreamStart
from zmlcore.policy import RouteRequest
from zmlcore.reply.parts import publish_reply

from zml_router.dispatch import (
    AttemptError,
    Failure,
    first_chunk_within,
    post_json,
    stream_sse,
    stream_usage,
)
from zml_router.firstbyte import expected_s, first_byte_timeout
from zml_router.kinds import PATHS
from zml_router.pendinghold import PendingHold, window_s
from zml_router.queue import QueuedMsg
from zml_router.rename import Renamer

if TYPE_CHECKING:
    from zml_router.service import RouterService

_encode = msgspec.json.encode
#: Zml-Accept-Stream values that get the node's events relayed as they came.
_RELAYED = (subjects.STREAM_EVENTS, subjects.STREAM_FRAMES)
_USAGE = re.compile(rb'"(prompt_tokens|completion_tokens|total_tokens)"\s*:\s*(\d+)')


def reply_usage(raw: bytes) -> dict[str, Any]:
    """The first prompt/completion/total token counts in a reply body, in one scan of it (for
    the metrics, the trace and the routing metadata alike), without decoding the body."""
    found: dict[str, Any] = {}
    for m in _USAGE.finditer(raw):
        found.setdefault(m.group(1).decode(), int(m.group(2)))
    return found


def with_routing(raw: bytes, info: RoutingInfo) -> bytes:
    """The node's JSON object with ``"zml": {...}`` appended, without re-encoding the body."""
    body = raw.rstrip()
    if body[:1] == b"{" and body[-1:] == b"}":
        sep = b"," if body[1:-1].strip() else b""
        return body[:-1] + sep + b'"zml":' + _encode(info) + b"}"
    raise AttemptError(Failure.SERVER, 200, f"node answered a non-object JSON body: {raw[:100]!r}")


def _routing_headers(msg: Msg | QueuedMsg, info: RoutingInfo) -> dict[str, str]:
    """The Zml-* routing headers of a reply, or none for a requester that reads the routing
    metadata from the body (``Zml-Accept-Routing: body``): it travels once."""
    if (msg.headers or {}).get(subjects.H_ACCEPT_ROUTING) == subjects.ROUTING_IN_BODY:
        return {}
    return routingmeta.nats_headers(info)


class Relay:
    def __init__(self, svc: RouterService) -> None:
        self.svc = svc
        self.api_keys = {n.id: n.api_key for n in svc.cfg.nodes if n.api_key}

    def _headers(self, info: RoutingInfo) -> dict[str, str]:
        h = {
            "content-type": "application/json",
            "x-zml-routing": routingmeta.backend_header(info),
            "x-request-id": info.request_id,
        }
        key = self.api_keys.get(info.node_id)
        if key:
            h["authorization"] = f"Bearer {key}"
        self.svc.metrics.dispatching(h, info)  # traceparent of the attempt span, when tracing
        return h

    def first_byte_s(self, node_id: str, req: InferRequest, rr: RouteRequest) -> float | None:
        """The attempt's first-byte deadline (none for a pinned request: it cannot move)."""
        view = self.svc.table.views.get(node_id)
        if view is None or req.accelerator_id is not None:
            return None
        rc = self.svc.cfg.router
        expected = expected_s(view.state, view.outstanding, view.pending, rr.prompt_tokens, rr.max_tokens, req.stream)
        return first_byte_timeout(expected, rc.first_byte_floor_s, rc.first_byte_factor)

    def _url(self, info: RoutingInfo, req: InferRequest) -> str:
        return self.svc.table.views[info.node_id].state.endpoint.rstrip("/") + PATHS[req.kind()]

    async def once(self, msg: Msg | QueuedMsg, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                   first_byte: float | None = None, rename: Renamer | None = None) -> None:
        svc = self.svc
        # A non-streamed reply shows no first token: pending ends at the estimated one.
        v = svc.table.views[info.node_id]
        hold = PendingHold(svc.sharing.move, info.node_id,
                           window_s(v.state, v.effective_outstanding(), v.effective_pending(), len(body)), svc.timers)
        try:
            call = post_json(svc.http, self._url(info, req), body, self._headers(info),  # type: ignore[arg-type]
                             svc.cfg.nats.max_reply_bytes)
            if first_byte is None:
                raw = await call
            else:
                try:
                    with svc.timers.deadline(first_byte):  # on the router's timer wheel (zml_router.timers)
                        raw = await call
                except TimeoutError:  # ours only: the request's own deadline arrives as a cancellation
                    raise AttemptError(Failure.SLOW, 0,
                                       f"no reply within the first-byte deadline of {first_byte:.1f} s") from None
        finally:
            hold.close()
        info.time_to_first_token = time.monotonic() - t0
        usage = reply_usage(raw)
        svc.metrics.usage_dict(req.kind(), req.model, usage)
        if rename is not None:
            raw = rename(raw)
        # Over max_payload: in parts to a requester that collects them (zmlcore.reply.bigreply), else
        # REPLY_TOO_LARGE (raised before anything is sent), never a lost reply.
        if "total_tokens" in usage:
            info.total_tokens = usage["total_tokens"]
        await svc.before_last_reply(info.total_tokens or 0)  # the caller may send again at once
        if msg.reply and svc.nc is not None:
            await publish_reply(svc.nc, msg.reply, with_routing(raw, info), _routing_headers(msg, info),
                                accepted(msg.headers))

    async def stream(self, msg: Msg | QueuedMsg, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                     first_byte: float | None = None, rename: Renamer | None = None) -> None:
        svc = self.svc
        count, publish, frame = svc.sharing.count, svc.publish, streamframe.encode
        await count(info.node_id, 1, 1)
        pending = 1
        started = False
        seq = 0
        # Relayed as the node framed it to a requester that writes SSE itself (the gateway);
        # as header-less frames when it asked for them (zmlcore.reply.streamframe).
        accept = (msg.headers or {}).get(subjects.H_ACCEPT_STREAM)
        relay = rename is None and accept in _RELAYED
        frames = relay and accept == subjects.STREAM_FRAMES
        kind = subjects.STREAM_EVENTS if relay else subjects.STREAM_CHUNK
        chunks = stream_sse(svc.http, self._url(info, req), body, self._headers(info), relay)  # type: ignore[arg-type]
        try:
            async for chunk in first_chunk_within(chunks, first_byte):
                if not started:
                    started = True
                    pending = 0
                    if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                        msg.placed.set_result(True)
                    await count(info.node_id, 0, -1)
                    info.time_to_first_token = time.monotonic() - t0
                    await publish(msg.reply, _encode(StreamStart(routing=info)),
                                  {**_routing_headers(msg, info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
                usage = stream_usage(chunk)
                if usage is not None:
                    info.total_tokens = usage["total_tokens"]
                    svc.metrics.usage_dict(req.kind(), req.model, usage)
                if rename is not None:
                    chunk = rename(chunk)
                seq += 1  # numbered so that a receiver notices a lost message (zmlcore.reply.streamseq)
                if frames:
                    await publish(msg.reply, frame(seq, chunk), None)
                else:
                    await publish(msg.reply, chunk, {subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)})
            if not started:  # a stream with no chunk at all
                info.time_to_first_token = time.monotonic() - t0
                await publish(msg.reply, _encode(StreamStart(routing=info)),
                              {**_routing_headers(msg, info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
            await svc.before_last_reply(info.total_tokens or 0)
            await publish(msg.reply, _encode(StreamStart(routing=info)),
                          {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(seq + 1)})
        except AttemptError as err:
            # Before the first token the flow re-dispatches invisibly; after it, it cools the
            # node and ends the stream with an error.
            err.mid_stream = started
            raise
        finally:
            await count(info.node_id, -1, -pending)
