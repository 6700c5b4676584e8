"""A streamed request: the router's reply messages relayed to the HTTP client as SSE."""

from __future__ import annotations

from typing import Any

import msgspec

from zmlcore import subjects
from zmlcore.errors import BackendError, StreamInterruptedError, ZMLError
from zmlcore.reply import routingmeta, streamframe
from zmlcore.reply.norouter import is_no_responders
from zmlcore.reply.streamseq import SeqCheck
from zml_gateway.asgi import Receive, Send, send_whole
from zml_gateway.infer.replies import broker_lost, error_answer, no_router, total_tokens
from zml_gateway.infer.upstream import BrokerLost, ClientGone, Outbound, Upstream

#: Stream messages that carry Zml-Seq (an error ends the stream whatever its number).
_SEQUENCED = ("start", subjects.STREAM_CHUNK, subjects.STREAM_EVENTS, subjects.STREAM_END)
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_encode = msgspec.json.encode


async def _sse_error(send: Send, body: Any) -> None:
    await send({"type": "http.response.body", "body": b"data: " + _encode(body) + b"\n\n"})


async def relay_stream(up: Upstream, out: Outbound, buffer: int, receive: Receive, send: Send) -> None:
    # Chunks wait in a bounded buffer while the HTTP client is slow to read (overflow: cancel).
    # SSE relayed as the node framed it, chunks as header-less frames (zmlcore.reply.streamframe).
    out.headers[subjects.H_ACCEPT_STREAM] = subjects.STREAM_FRAMES
    ex = up.exchange(out, buffer)
    stop = up.watch(ex, receive)
    started = False
    seq = SeqCheck()  # a lost message ends the stream with an error, never silently short
    try:
        await ex.send()
        while True:
            try:
                msg = await ex.next()  # TIMEOUT past the request's timeout (+1 s grace)
            except ClientGone:
                await up.cancel(out)
                return
            except BrokerLost:  # chunks sent while the broker was away are lost
                await up.cancel(out)
                if started:
                    await _sse_error(send, StreamInterruptedError(
                        "the broker connection was lost mid-stream; the stream is incomplete").to_body())
                    return
                raise broker_lost() from None
            except ZMLError as exc:  # its router gone (STREAM_INTERRUPTED once relaying), or TIMEOUT
                await up.cancel(out)
                if started:
                    await _sse_error(send, exc.to_body())
                    return
                raise
            if ex.overflowed:
                await up.cancel(out)
                slow = BackendError(f"client read too slowly: more than {ex.buffer} chunks waiting; "
                                    "request cancelled")
                if started:
                    await _sse_error(send, slow.to_body())
                    return
                raise slow
            if msg.headers is None:  # a frame: events, written with any that queued up behind it
                body, lost = streamframe.collect(msg.data, ex.next_frame, seq)
                if body:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                if lost is None:
                    continue
                await up.cancel(out)
                if not started:
                    raise lost
                await _sse_error(send, lost.to_body())
                return
            mh = msg.headers
            if is_no_responders(mh, msg.data):
                # The broker's "no responders" status (routers not re-subscribed yet after a
                # restart): a clean retryable error, not an empty 500.
                gone = no_router()
                if not started:
                    raise gone
                await _sse_error(send, gone.to_body())
                return
            kind = mh.get(subjects.H_STREAM)
            gap = seq.gap(mh.get(subjects.H_SEQ)) if kind in _SEQUENCED else None
            if gap is not None:
                await up.cancel(out)
                lost = StreamInterruptedError(f"{gap}; the stream is incomplete")
                if not started:
                    raise lost
                await _sse_error(send, lost.to_body())
                return
            if kind == subjects.STREAM_EVENTS:  # whole SSE events, relayed as the node framed them
                await send({"type": "http.response.body", "body": msg.data, "more_body": True})
            elif kind == subjects.STREAM_CHUNK:
                await send({"type": "http.response.body", "body": b"data: " + msg.data + b"\n\n", "more_body": True})
            elif kind == "start":
                info = None if subjects.H_NODE_ID in mh else routingmeta.from_start(msg.data)
                routing = routingmeta.http_headers_of(info) if info is not None else routingmeta.http_headers(mh)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*SSE_HEADERS, *out.limits, *routing]})
                started = True
            elif kind == subjects.STREAM_END:
                out.tokens = total_tokens(msg.data)
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
            else:  # error (or a non-stream reply from a router that ignored stream)
                code = mh.get(subjects.H_ERROR_CODE, "INTERNAL")
                if not started:
                    await send_whole(send, *error_answer(code, msg.data, mh.get(subjects.H_RETRY_AFTER), out.limits))
                else:
                    await send({"type": "http.response.body", "body": b"data: " + msg.data + b"\n\n"})
                return
    finally:
        stop()
        ex.close()
