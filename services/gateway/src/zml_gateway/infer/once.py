"""A non-streamed request: one NATS exchange, one whole reply (put back together when it came
in parts), written in one go with the routing metadata as HTTP headers."""

from __future__ import annotations

from zmlcore import subjects
from zmlcore.errors import ZMLError
from zmlcore.reply import routingmeta
from zmlcore.reply.norouter import is_no_responders
from zml_gateway.asgi import JSON, Receive, Send, content_length, send_whole
from zml_gateway.infer.replies import broker_lost, error_answer, no_router, total_tokens
from zml_gateway.infer.upstream import BrokerLost, ClientGone, Outbound, Upstream


async def answer_once(up: Upstream, out: Outbound, receive: Receive, send: Send) -> None:
    ex = up.exchange(out)
    await ex.send()
    # The client going away cancels the request on the node; a reply sent while the broker
    # was away is lost: neither waits the whole timeout.
    stop = up.watch(ex, receive)
    try:
        reply = await ex.reply()
    except ClientGone:
        await up.cancel(out)
        return
    except BrokerLost:
        await up.cancel(out)
        raise broker_lost() from None
    except ZMLError:  # TIMEOUT, or its router gone (and gone again after a resend)
        await up.cancel(out)
        raise
    finally:
        stop()
        ex.close()
    rh = reply.headers or {}
    data = reply.data
    if is_no_responders(rh, data):
        raise no_router()
    code = rh.get(subjects.H_ERROR_CODE)
    if code is not None:
        await send_whole(send, *error_answer(code, data, rh.get(subjects.H_RETRY_AFTER), out.limits))
        return
    ctype = rh.get(subjects.H_CONTENT_TYPE)
    if ctype is not None:  # an audio answer: the node's bytes and content type, the routing in headers
        out.tokens = total_tokens(data)
        await send_whole(send, 200, data, [(b"content-type", ctype.encode("latin-1")), content_length(data),
                                           *out.limits, *routingmeta.http_headers(rh)])
        return
    info = routingmeta.from_body(data)  # asked for in the body only (Zml-Accept-Routing)
    if info is not None:
        headers = [JSON, content_length(data), *out.limits, *routingmeta.http_headers_of(info)]
        out.tokens = info.total_tokens or 0
    else:
        headers = [JSON, content_length(data), *out.limits, *routingmeta.http_headers(rh)]
        out.tokens = total_tokens(data)
    await send_whole(send, 200, data, headers)
