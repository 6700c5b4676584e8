"""One inference request on ``zml.infer`` and its reply messages, with router failover: the
gateway's and the SDK's NATS path (the I/O beside :mod:`zmlcore.reply.keepalive`).

The request declares ``Zml-Keepalive``; keepalives are consumed here and never reach the
caller. When the router falls silent for ``keepalive.MISSES`` intervals it is taken for dead:
before anything of the answer was returned, the request is published once more (same request
id, same headers, ``Zml-Resend: 1``, the timeout left, and a **new reply inbox**, so a late
message of the first attempt is dropped rather than mixed in). A stream (``resume=True``)
whose content went out already is sent again as a *continuation* of what was received
(``Zml-Resume``, :mod:`zmlcore.reply.resume`): the next router continues the answer where the
caller's copy ends and numbers on from its last message, so the caller reads one stream. When
that is not possible, or fails too, :meth:`Exchange.next` raises a clean retryable error at
once instead of waiting out the timeout (STREAM_INTERRUPTED for a stream already relayed,
else BACKEND_ERROR).

A broker connection that drops and comes back (a broker restarted, a blink) may have lost
anything published meanwhile, in either direction. :meth:`Exchange.follow` watches the
connection: while it is down the router's silence counts for nothing, and when it is back the
request is sent again (:func:`zmlcore.reply.keepalive.after_reconnect`: the router that holds it
replaces it; a stream is continued from what was received; a request waiting in the saturation
queue is left there). Only a connection closed for good, or a reply partly passed on that cannot
be continued, ends it (the ``BrokerLost`` abort the caller gives).

The broker's "no responders" status (no router subscribed: for a moment after a broker
restart, or while routers restart) means nothing received the request: with
``no_router_grace_s`` it is sent again after a short backoff (:mod:`zmlcore.reply.norouter`) until a
router answers or the grace (or the request's timeout) runs out; then :meth:`Exchange.next`
returns that status message and the caller answers NO_HEALTHY_NODES as before.

Replies arrive through one wildcard subscription per connection (:class:`ReplyMux`, like
nats-py's own request mux): no SUB/UNSUB round per request.

A body larger than one NATS message (audio) is uploaded: the request goes out with an empty
body and ``Zml-Upload-Bytes``, and when the router that took it answers ``Zml-Upload-To`` the
body follows there in parts (zmlcore.subjects, "Requests larger than one NATS message"); a
resend uploads it again to the router that takes the resend.

Example::

    ex = Exchange(nc, body, headers, timeout_s=30, keepalive_s=1.0)
    await ex.send()
    try:
        msg = await ex.next()      # the reply (or, for a stream, its next message)
    finally:
        ex.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from zmlcore import subjects
from zmlcore.bus.direct import subscribe_direct
from zmlcore.bus.link import Link
from zmlcore.bus.publish import publish
from zmlcore.reply import parts
from zmlcore.reply.bigreply import Collector, part_bytes, split
from zmlcore.errors import BackendError, StreamInterruptedError, TimeoutError
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.reply.keepalive import (
    MAX_INTERVAL_MS,
    MIN_INTERVAL_MS,
    QUEUED,
    Silence,
    after_reconnect,
    after_silence,
    keepalive_state,
)
from zmlcore.reply.norouter import NoRouterWait, is_no_responders
from zmlcore.messages import StreamResume
from zmlcore.reply.resume import Received
from zmlcore.reply.resume import encode as resume_header

log = logging.getLogger("zml.exchange")


def parts_buffer(max_reply_bytes: int, max_payload: int | None) -> int:
    """Messages a plain reply's buffer must hold: every part of the largest reply collected
    (they are published back to back), plus keepalives."""
    return -(-max_reply_bytes // part_bytes(max_payload)) + 16


class Sink:
    """One exchange's reply messages: a bounded deque and at most one waiting reader.

    A plain future is woken per message, and a timer (not a Task, not ``wait_for``) bounds
    the wait: the per-message cost is a deque append and, when the reader waits, one
    ``set_result``. The timer outlives a wait that a message ended: the next wait keeps it
    when it fires no later than that wait's deadline (it wakes the reader early at worst,
    who waits again), so a stream pays for a timer per keepalive interval, not per chunk.
    :meth:`abort` wakes the reader with an exception (its client gone, the broker lost)."""

    __slots__ = ("_msgs", "_max", "_waiter", "_timer", "_timer_at", "overflowed", "aborted")

    def __init__(self, maxsize: int) -> None:
        self._msgs: deque[Msg] = deque()
        self._max = maxsize
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.overflowed = False
        self.aborted: BaseException | None = None

    def push(self, msg: Msg) -> None:
        msgs = self._msgs
        if len(msgs) >= self._max:  # the caller reads slower than the router writes
            self.overflowed = True
            return
        msgs.append(msg)
        w = self._waiter  # _wake(), inline: this runs for every message of every reply
        if w is not None and not w.done():
            w.set_result(None)

    def abort(self, exc: BaseException) -> None:
        if self.aborted is None:
            self.aborted = exc
            self._wake()

    def wake(self) -> None:
        """Wake the reader without a message (it checks what changed)."""
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def empty(self) -> bool:
        return not self._msgs and self.aborted is None

    def pop(self) -> Msg | None:
        if self.aborted is not None:
            raise self.aborted
        return self._msgs.popleft() if self._msgs else None

    def pop_frame(self) -> Msg | None:
        """The next message if it is here already and header-less (a stream frame,
        zmlcore.reply.streamframe), else None."""
        msgs = self._msgs
        if msgs and self.aborted is None and msgs[0].headers is None:
            return msgs.popleft()
        return None

    async def wait(self, timeout: float) -> None:
        """Until a message (or an abort) arrives or ``timeout`` passes, whichever is first."""
        if self._msgs or self.aborted is not None:
            return
        loop = asyncio.get_running_loop()
        w = self._waiter = loop.create_future()
        at = loop.time() + timeout
        if self._timer is None or self._timer_at > at:  # none armed, or one that fires too late
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._expire)
            self._timer_at = at
        try:
            await w
        finally:
            self._waiter = None

    def _expire(self) -> None:
        self._timer = None
        self._wake()

    def close(self) -> None:
        """No more waits: the armed timer goes (it would hold the sink until it fires)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ReplyMux:
    """One subscription to ``<inbox>.*`` per connection; each exchange owns one token of it."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox() + "."
        self._cut = len(self.prefix)
        self._sinks: dict[str, Sink] = {}
        self._next = 0

    @classmethod
    async def of(cls, nc: NATS) -> ReplyMux:
        fut = _MUXES.get(nc)
        if fut is None:
            fut = _MUXES[nc] = asyncio.get_running_loop().create_future()
            mux = cls(nc)
            try:
                await subscribe_direct(nc, mux.prefix + "*", mux.deliver)  # no task switch per message
            except BaseException as exc:
                del _MUXES[nc]
                fut.set_exception(exc)
                fut.exception()  # retrieved: a later caller makes its own attempt
                raise
            fut.set_result(mux)
        if fut.done():
            return fut.result()
        return await asyncio.shield(fut)

    def open(self, maxsize: int) -> tuple[str, Sink]:
        self._next += 1  # the prefix is random: a counter is enough under it
        token = str(self._next)
        sink = self._sinks[token] = Sink(maxsize)
        return self.prefix + token, sink

    def close(self, inbox: str) -> None:
        sink = self._sinks.pop(inbox[self._cut:], None)
        if sink is not None:
            sink.close()

    def deliver(self, msg: Msg) -> None:
        sink = self._sinks.get(msg.subject[self._cut:])
        if sink is not None:  # else a closed exchange, or an attempt given up on: dropped
            sink.push(msg)


_MUXES: weakref.WeakKeyDictionary[NATS, asyncio.Future[ReplyMux]] = weakref.WeakKeyDictionary()


class Exchange:
    """Publish a request to the routers and read its reply messages (see the module doc).

    ``timeout_s`` is the request's own timeout (what the router enforces); ``wait_s`` how long
    the caller waits in all (the timeout plus some grace), after which :meth:`next` raises
    TIMEOUT. ``keepalive_s`` None: no keepalives asked, no failover (the old behaviour).
    ``no_router_grace_s``: how long "no responders" is waited out (0: returned at once).
    ``resume``: the request is a stream whose received messages are kept (:attr:`received`) so
    that a dead router's stream can be continued by another (zmlcore.reply.resume).
    """

    def __init__(self, nc: NATS, body: bytes, headers: dict[str, str], *, timeout_s: float,
                 keepalive_s: float | None, wait_s: float | None = None, buffer: int = 64,
                 subject: str = subjects.INFER, accept_parts: int | None = None,
                 no_router_grace_s: float = 0.0, resume: bool = False) -> None:
        self.nc = nc
        self.subject = subject
        self.body = body
        self.headers = dict(headers)
        if keepalive_s is not None:  # as the router clamps it: the watch must expect what it gets
            keepalive_s = min(max(keepalive_s, MIN_INTERVAL_MS / 1000), MAX_INTERVAL_MS / 1000)
            self.headers[subjects.H_KEEPALIVE] = str(int(keepalive_s * 1000))
        self.keepalive_s = keepalive_s
        #: Replies over max_payload are collected in parts up to this many bytes (zmlcore.reply.bigreply).
        self.accept_parts = accept_parts
        if accept_parts:
            self.headers[subjects.H_ACCEPT_PARTS] = str(accept_parts)
        self.t0 = time.monotonic()
        self.timeout_s = timeout_s
        self.wait_until = self.t0 + (wait_s if wait_s is not None else timeout_s)
        self.buffer = buffer
        #: Something of the answer was returned: the request cannot be sent again invisibly.
        self.committed = False
        self.resends = 0
        #: What the caller was handed of a stream, for a continuation (None: not kept).
        self.received = Received() if resume else None
        self._add_frame = self.received.add_frame if self.received is not None else None
        self._resume = ""  # the Zml-Resume of the continuation sent, while no router has it
        #: Broker reconnects lived through (each sends the request again), and one to act on.
        self.blinks = 0
        self._blinked = False
        self._link: Link | None = None  # followed (follow()): told of reconnects
        self._lost: Callable[[], BaseException] | None = None
        self._mux: ReplyMux | None = None
        self._inbox = ""
        self._sink: Sink | None = None
        self._silence: Silence | None = None
        self._aborted: BaseException | None = None
        self._no_router = NoRouterWait(no_router_grace_s) if no_router_grace_s > 0 else None
        #: The body goes in parts, when the router asks (it is over one message).
        self.upload = len(body) > part_bytes(nc.max_payload or None)
        self._uploaded = ""  # the inbox whose router has had the body (one upload per attempt)

    @property
    def request_id(self) -> str:
        return self.headers.get(subjects.H_REQUEST_ID, "")

    @property
    def overflowed(self) -> bool:
        return self._sink is not None and self._sink.overflowed

    def abort(self, exc: BaseException) -> None:
        """Make the waiting (or next) :meth:`next` raise ``exc``: the caller's client went away,
        or its broker connection was lost. Meant to be called from a callback or another task."""
        self._aborted = exc
        if self._sink is not None:
            self._sink.abort(exc)

    def reconnected(self) -> None:
        """The broker connection came back (call from a callback): the waiting (or next)
        :meth:`next` sends the request again (see the module doc)."""
        self._blinked = True
        if self._sink is not None:
            self._sink.wake()

    def follow(self, link: Link, lost: Callable[[], BaseException]) -> Callable[[], None]:
        """Watch the connection while the request runs: a reconnect sends it again
        (:meth:`reconnected`), a close for good aborts it with ``lost()``. Returns what stops
        watching (:meth:`close` stops it too). No task and no closure: the exchange is one
        entry in the connection's :class:`~zmlcore.bus.link.Link` until it stops (a closure
        that re-registered itself made a reference cycle per request, and the collector's runs
        cost every request ~7% of the gateway's CPU)."""
        self._link, self._lost = link, lost
        link.follow(self)
        return self.unfollow

    def unfollow(self) -> None:
        """Stop watching the connection (see :meth:`follow`)."""
        link = self._link
        if link is not None:
            self._link = None
            link.unfollow(self)

    def link_changed(self, link: Link) -> None:
        """The followed connection came back, or closed for good (called by the Link)."""
        if link.closed.is_set():
            assert self._lost is not None
            self.abort(self._lost())
        else:
            self.reconnected()

    async def send(self) -> None:
        """Publish the request (first attempt)."""
        self._mux = await ReplyMux.of(self.nc)
        await self._publish(self.headers)

    async def _publish(self, headers: dict[str, str]) -> None:
        assert self._mux is not None
        if self._inbox:
            self._mux.close(self._inbox)
        self._inbox, self._sink = self._mux.open(self.buffer)
        if self._aborted is not None:
            self._sink.abort(self._aborted)
        if self.keepalive_s is not None:
            self._silence = Silence(self.keepalive_s, time.monotonic())
        if self.upload:  # the body follows when its router asks for it (Zml-Upload-To)
            await publish(self.nc, self.subject, b"", reply=self._inbox,
                          headers={**headers, subjects.H_UPLOAD_BYTES: str(len(self.body))})
            return
        await publish(self.nc, self.subject, self.body, reply=self._inbox, headers=headers)

    async def _send_body(self, to: str) -> None:
        """The router that took this attempt asks for the body: every part, in order, at once."""
        if not self.upload or self._uploaded == self._inbox or not to.startswith(subjects.UPLOAD_PREFIX + "."):
            return  # asked twice, or not an upload subject: nothing of the body goes anywhere else
        self._uploaded = self._inbox
        for data, headers in split(self.body, {}, part_bytes(self.nc.max_payload or None)):
            await publish(self.nc, to, data, headers=headers)

    async def next(self) -> Msg:
        """The next reply message (keepalives consumed). Raises TIMEOUT once ``wait_s`` has
        passed, and BACKEND_ERROR / STREAM_INTERRUPTED when the router is gone for good."""
        assert self._sink is not None, "send() first"
        while True:
            if self._blinked:
                await self._after_blink()
            sink = self._sink  # a new one after a resend
            msg = sink.pop()  # raises what abort() was given
            if msg is None:
                now = time.monotonic()
                left = self.wait_until - now
                if left <= 0:
                    raise TimeoutError(f"no reply within {self.timeout_s:g} s") from None
                silent = self._silence.wait_s(now) if self._silence is not None else None
                await sink.wait(left if silent is None else min(left, silent))
                if sink.empty and self._silence is not None and self._silence.gone(time.monotonic()):
                    if not self.nc.is_connected:  # nothing can arrive: the reconnect resends it
                        self._silence.offline(time.monotonic())
                        continue
                    await self._router_gone()
                continue
            if msg.headers is not None and subjects.H_UPLOAD_TO in msg.headers and not msg.data:
                await self._send_body(msg.headers[subjects.H_UPLOAD_TO])
                if self._silence is not None:  # the upload took its time: the router is alive
                    self._silence.heard(time.monotonic())
                continue
            state = keepalive_state(msg.headers)
            if state is not None and not msg.data:
                if self._silence is not None:
                    if state == QUEUED:
                        self._silence.queued()
                    else:
                        self._silence.heard(time.monotonic())
                continue
            if self._no_router is not None and (not self.committed or self._resume) and \
                    is_no_responders(msg.headers, msg.data):
                if await self._wait_for_router(sink):
                    continue
            if self._silence is not None:
                self._silence.heard(time.monotonic())
            self.committed = True
            self._resume = ""  # a router has the continuation
            received = self.received
            if received is not None:
                if msg.headers is None:  # a stream's chunk frame: one append
                    received.frame(msg.data)
                else:
                    received.message(msg.headers, msg.data)
            return msg

    def next_frame(self) -> Msg | None:
        """The next stream frame if it has arrived already (None: wait with :meth:`next`):
        frames that queued up while the caller was busy go out in one write."""
        sink = self._sink
        msg = sink.pop_frame() if sink is not None else None
        if msg is not None:
            add = self._add_frame
            if add is not None:
                add(msg.data)  # a list append; next() folds a long answer's frames
        return msg

    async def reply(self) -> parts.Reply:
        """The whole non-streamed reply, put back together when it comes in parts (a part
        missing, more than PART_WAIT_S late, or its router gone: REPLY_INCOMPLETE, retryable)."""
        collector = Collector(self.accept_parts or 0)
        while True:
            if not collector.started:
                msg = await self.next()
            else:
                try:
                    msg = await asyncio.wait_for(self.next(), parts.PART_WAIT_S)
                except (asyncio.TimeoutError, StreamInterruptedError):
                    raise collector.lost() from None
            body = collector.feed(msg.data, msg.headers)
            if body is not None:
                return parts.Reply(body, collector.headers)

    async def _wait_for_router(self, sink: Sink) -> bool:
        """After "no responders": wait the backoff's next delay, then publish again (True), or
        False when the grace or the request's timeout is spent. An abort (client gone, broker
        lost) ends the wait at once and is raised."""
        assert self._no_router is not None
        now = time.monotonic()
        deadline = self.t0 + self.timeout_s
        delay = self._no_router.delay(now, deadline)
        if delay is None:
            return False
        until = now + delay
        while sink.empty and (left := until - time.monotonic()) > 0:
            await sink.wait(left)
        if sink.aborted is not None:
            raise sink.aborted
        # Nothing received it: the same request (and resend count, if a dead router's request
        # found no router), with the timeout left.
        headers = {**self.headers, subjects.H_TIMEOUT_MS: str(max(1, int((deadline - time.monotonic()) * 1000)))}
        if self.resends:
            headers[subjects.H_RESEND] = str(self.resends)
        if self._resume:
            headers[subjects.H_RESUME] = self._resume
        await self._publish(headers)
        return True

    async def continue_lost(self) -> bool:
        """A message of this stream was lost (the caller's sequence check saw a number skipped,
        its own connection up): have a router continue it from what was received before the
        loss (``Zml-Resume``), as after a reconnect. False: it cannot be (not a stream kept
        with ``resume``, one that may not be continued as it is, or too many times already);
        then the caller ends it as interrupted."""
        if not self._inbox:
            return False
        remaining = self.t0 + self.timeout_s - time.monotonic()
        resume = self.received.resume() if self.received is not None else None
        if after_reconnect(committed=True, resumable=resume is not None, parked=False, blinks=self.blinks,
                           remaining_s=remaining) != "resume":
            return False
        assert resume is not None
        log.info("request %s: a message of its stream was lost; sending it again to continue after %d chunks",
                 self.request_id, resume.tokens)
        await self._send_again(remaining, resume)
        return True

    async def _send_again(self, remaining: float, resume: StreamResume | None) -> None:
        """Publish the request again after a reconnect or a lost message (a stream as a continuation)."""
        self.blinks += 1
        self.resends += 1
        headers = {**self.headers, subjects.H_RESEND: str(self.resends),
                   subjects.H_TIMEOUT_MS: str(max(1, int(remaining * 1000)))}
        if resume is not None:
            self._resume = headers[subjects.H_RESUME] = resume_header(resume)
        await self._publish(headers)

    async def _after_blink(self) -> None:
        """The broker connection came back: send the request again, as a continuation for a
        stream under way (keepalive.after_reconnect)."""
        self._blinked = False
        if not self._inbox:  # closed
            return
        remaining = self.t0 + self.timeout_s - time.monotonic()
        resume = self.received.resume() if self.committed and self.received is not None else None
        decision = after_reconnect(committed=self.committed, resumable=resume is not None,
                                   parked=self._silence is not None and self._silence.parked,
                                   blinks=self.blinks, remaining_s=remaining)
        if decision == "wait":
            return
        if decision == "fail":
            self.close()
            if self.committed:
                raise StreamInterruptedError("the broker connection was lost mid-reply and the reply cannot be "
                                             "continued; it is incomplete", retry_after=1.0)
            raise ZMLConnectionError("the broker connection was lost while the request was in flight; retry",
                                     retry_after=0.5)
        log.info("request %s: the broker connection came back; sending it again%s", self.request_id,
                 f" to continue its stream after {resume.tokens} chunks" if resume is not None else "")
        await self._send_again(remaining, resume)

    async def _router_gone(self) -> None:
        assert self.keepalive_s is not None
        remaining = self.t0 + self.timeout_s - time.monotonic()
        resume = self.received.resume() if self.committed and self.received is not None else None
        decision = after_silence(committed=self.committed, resends=self.resends, remaining_s=remaining,
                                 interval_s=self.keepalive_s, resumable=resume is not None)
        silent_s = self.keepalive_s * 3
        if decision == "resume":
            assert resume is not None
            self.resends += 1
            self._resume = resume_header(resume)
            log.warning("request %s: the router relaying its stream sent nothing for %.1f s; another continues "
                        "it after %d chunks", self.request_id, silent_s, resume.tokens)
            await self._publish({**self.headers, subjects.H_RESEND: str(self.resends),
                                 subjects.H_TIMEOUT_MS: str(max(1, int(remaining * 1000))),
                                 subjects.H_RESUME: self._resume})
            return
        if decision == "resend":
            self.resends += 1
            log.warning("request %s: its router sent nothing for %.1f s; sending it again", self.request_id, silent_s)
            headers = {**self.headers, subjects.H_RESEND: str(self.resends),
                       subjects.H_TIMEOUT_MS: str(max(1, int(remaining * 1000)))}
            await self._publish(headers)
            return
        self.close()
        if self.committed:
            raise StreamInterruptedError(
                f"the router relaying this stream sent nothing for {silent_s:.1f} s (it is gone); "
                "the stream is incomplete", retry_after=1.0)
        raise BackendError(
            f"the router handling this request sent nothing for {silent_s:.1f} s"
            f"{' after it was sent again' if self.resends else ''}; retry", retry_after=1.0)

    def close(self) -> None:
        """Stop receiving (later messages of any attempt are dropped)."""
        if self._link is not None:
            self.unfollow()
        if self._mux is not None and self._inbox:
            self._mux.close(self._inbox)
            self._inbox = ""

    def __enter__(self) -> Exchange:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
