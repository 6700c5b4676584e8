"""A streamed request: the router's reply messages relayed to the HTTP client as SSE.

The I/O only: what each message means and what to write is the relay's
(:class:`zml_gateway.infer.relay.StreamRelay`). Chunks wait in the exchange's bounded buffer
while the client is slow to read (overflow: cancel); they come as header-less frames
(zmlcore.reply.streamframe), those that queued up behind one written with it.
"""

from __future__ import annotations

from zmlcore import subjects
from zmlcore.errors import ZMLError
from zml_gateway.asgi import Receive, Send, send_whole
from zml_gateway.infer.relay import Continue, Fail, Finish, Refuse, Start, StreamRelay
from zml_gateway.infer.upstream import BrokerLost, ClientGone, Outbound, Upstream


async def relay_stream(up: Upstream, out: Outbound, buffer: int, receive: Receive, send: Send) -> None:
    out.headers[subjects.H_ACCEPT_STREAM] = subjects.STREAM_FRAMES
    ex = up.exchange(out, buffer)
    stop = up.watch(ex, receive)
    relay = StreamRelay(out.limits)
    try:
        await ex.send()
        while True:
            try:
                msg = await ex.next()  # TIMEOUT past the request's timeout (+1 s grace)
            except ClientGone:
                action = relay.client_gone()
            except BrokerLost:
                action = relay.broker_lost()
            except ZMLError as exc:  # its router gone, or TIMEOUT
                action = relay.failed(exc)
            else:
                if ex.overflowed:
                    action = relay.overflowed(ex.buffer)
                elif msg.headers is None:
                    action = relay.frames(msg.data, ex.next_frame)
                else:
                    action = relay.message(msg.headers, msg.data)
            if action is None:
                continue
            if type(action) is bytes:  # per chunk: first
                await send({"type": "http.response.body", "body": action, "more_body": True})
                continue
            if isinstance(action, Continue):  # a message lost: another router continues from before it
                if action.body:
                    await send({"type": "http.response.body", "body": action.body, "more_body": True})
                if await ex.continue_lost():
                    continue
                action = relay.lost(action)
            if isinstance(action, Start):
                await send({"type": "http.response.start", "status": 200, "headers": action.headers})
                continue
            # The end: the plan's tokens known before the last message (it frees the plan's slot).
            out.tokens = relay.total_tokens
            if isinstance(action, Finish):
                if action.cancel:
                    await up.cancel(out)
                if action.body is not None:
                    await send({"type": "http.response.body", "body": action.body})
            elif isinstance(action, Fail):
                if action.cancel:
                    await up.cancel(out)
                raise action.error
            elif isinstance(action, Refuse):
                await send_whole(send, action.status, action.body, action.headers)
            return
    finally:
        stop()
        ex.close()
