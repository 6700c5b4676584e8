"""zmlcore.reply.exchange against a real nats-server: keepalives are consumed, a silent router's
request is sent again once (same id, new inbox, the timeout left), a late reply of the first
attempt is never mixed in, a started stream ends with STREAM_INTERRUPTED, a queued request is
never sent again (out of the queue it is watched again: tests/e2e/test_router_failover.py), and
without keepalives nothing changes. The "routers" here are scripted
responders on a subject of the test's own: what they do is the point of each test."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import pytest

from zmlcore import subjects
from zmlcore.errors import BackendError, StreamInterruptedError, TimeoutError
from zmlcore.reply.exchange import Exchange
from zmlcore.reply.keepalive import MISSES, QUEUED, keepalive_headers
from zmlcore.bus.publish import flush

KA = 0.15  # keepalive interval of these tests: a silent router is gone after 0.45 s


@pytest.fixture()
async def nc(nats_url: str) -> AsyncIterator[Any]:
    c = await nats.connect(nats_url)
    yield c
    await c.close()


Script = Callable[[Any, int], Awaitable[None]]


async def responder(nc: Any, subject: str, script: Script) -> tuple[Any, list[Any]]:
    """Runs ``script(msg, attempt)`` for each request (attempt 1, 2, ...); returns the requests."""
    seen: list[Any] = []

    async def on(msg: Any) -> None:
        seen.append(msg)
        asyncio.ensure_future(script(msg, len(seen)))

    return await nc.subscribe(subject, cb=on), seen


def subject() -> str:
    return f"test.exchange.{os.urandom(4).hex()}"


def exchange(nc: Any, subj: str, **kw: Any) -> Exchange:
    kw.setdefault("keepalive_s", KA)
    kw.setdefault("timeout_s", 20.0)
    return Exchange(nc, b"{}", {subjects.H_REQUEST_ID: "r1", subjects.H_TIMEOUT_MS: "20000"}, subject=subj, **kw)


async def test_keepalives_are_consumed_and_the_reply_returned(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        for _ in range(4):  # 0.8 s of work, more than a silent router would get
            await asyncio.sleep(KA)
            await nc.publish(msg.reply, b"", headers=keepalive_headers())
        await nc.publish(msg.reply, b'{"ok": true}')

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj)
    await ex.send()
    reply = await ex.next()
    ex.close()
    assert reply.data == b'{"ok": true}' and len(seen) == 1 and ex.resends == 0
    assert seen[0].headers[subjects.H_KEEPALIVE] == str(int(KA * 1000))


async def test_a_silent_router_is_replaced_and_its_late_reply_dropped(nc: Any) -> None:
    subj = subject()
    first_reply: list[str] = []

    async def script(msg: Any, attempt: int) -> None:
        if attempt == 1:  # "killed": silent, then a late answer on the first inbox
            first_reply.append(msg.reply)
            await asyncio.sleep(MISSES * KA + 0.5)
            await nc.publish(msg.reply, b'{"from": 1}')
            return
        for _ in range(4):  # working (and saying so) until after attempt 1's late answer went out
            await asyncio.sleep(KA)
            await nc.publish(msg.reply, b"", headers=keepalive_headers())
        await nc.publish(msg.reply, b'{"from": 2}')

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj)
    t0 = time.monotonic()
    await ex.send()
    reply = await ex.next()
    ex.close()
    assert reply.data == b'{"from": 2}'
    assert len(seen) == 2 and ex.resends == 1
    again = seen[1]
    assert again.reply != first_reply[0]
    assert again.headers[subjects.H_REQUEST_ID] == "r1" and again.headers[subjects.H_RESEND] == "1"
    assert 0 < int(again.headers[subjects.H_TIMEOUT_MS]) < 20000  # the timeout left, not a new one
    assert time.monotonic() - t0 < 5


async def test_gone_twice_ends_with_a_clean_error_quickly(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        return  # every router dies

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj)
    t0 = time.monotonic()
    await ex.send()
    with pytest.raises(BackendError) as e:
        await ex.next()
    assert type(e.value) is BackendError and e.value.retryable and e.value.retry_after
    assert len(seen) == 2
    assert time.monotonic() - t0 < 2 * MISSES * KA + 2  # not the 20 s timeout


async def test_a_started_stream_is_interrupted_not_resent(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        await nc.publish(msg.reply, b"{}", headers={subjects.H_STREAM: "start", subjects.H_SEQ: "0"})

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj)
    await ex.send()
    first = await ex.next()
    assert first.headers[subjects.H_STREAM] == "start"
    t0 = time.monotonic()
    with pytest.raises(StreamInterruptedError) as e:
        await ex.next()
    assert e.value.retryable and len(seen) == 1
    assert time.monotonic() - t0 < MISSES * KA + 2


async def test_a_queued_request_is_never_sent_again(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        await nc.publish(msg.reply, b"", headers=keepalive_headers(QUEUED))
        await asyncio.sleep(MISSES * KA * 2)  # waits in the queue, silent: not a dead router
        await nc.publish(msg.reply, b"", headers=keepalive_headers())  # out of the queue
        await asyncio.sleep(KA)
        await nc.publish(msg.reply, b'{"served": true}')

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj)
    await ex.send()
    reply = await ex.next()
    ex.close()
    assert reply.data == b'{"served": true}' and len(seen) == 1 and ex.resends == 0


async def test_without_keepalives_nothing_changes(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        return

    _, seen = await responder(nc, subj, script)
    ex = exchange(nc, subj, keepalive_s=None, timeout_s=0.5, wait_s=0.7)  # a router gone: 0.45 s
    t0 = time.monotonic()
    await ex.send()
    with pytest.raises(TimeoutError):
        await ex.next()
    assert time.monotonic() - t0 >= 0.65
    assert len(seen) == 1 and subjects.H_KEEPALIVE not in (seen[0].headers or {})


async def test_a_slow_reader_overflows_its_own_buffer_only(nc: Any) -> None:
    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        for i in range(10):
            await nc.publish(msg.reply, b"x", headers={subjects.H_STREAM: "chunk"})

    await responder(nc, subj, script)
    small, other = exchange(nc, subj, buffer=3), exchange(nc, subj)
    await small.send()
    await other.send()
    deadline = time.monotonic() + 5
    while not small.overflowed and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    assert small.overflowed and not other.overflowed
    small.close()
    other.close()


async def test_replies_skip_the_subscription_queue_and_keep_nats_py_accounting(nc: Any) -> None:
    """With the installed nats-py, the reply mux takes messages from its reader directly (no
    queue and task hop per message: zmlcore.bus.natsinternals.deliver_directly), in order, and nats-py's
    pending-bytes count stays at zero (else its slow-consumer check would trip on a long
    stream)."""
    from zmlcore.bus.natsinternals import _Deliver
    from zmlcore.reply.exchange import ReplyMux

    mux = await ReplyMux.of(nc)
    sub = next(s for s in nc._subs.values() if s.subject == mux.prefix + "*")
    assert isinstance(sub._pending_queue, _Deliver)
    inbox, sink = mux.open(1000)
    for i in range(500):
        await nc.publish(inbox, b"%d" % i + b"x" * 1000)
    await flush(nc)
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < 500 and time.monotonic() < deadline:
        msg = sink.pop()
        if msg is None:
            await sink.wait(0.5)
            continue
        got.append(msg.data)
    assert [int(d.rstrip(b"x")) for d in got] == list(range(500))
    assert sub._pending_size == 0 and sub.pending_msgs == 0
    mux.close(inbox)


# --- "no responders": no router subscribed yet (zmlcore.reply.norouter) -------------------------------


async def test_a_request_that_found_no_router_is_sent_again_when_one_subscribes(nc: Any) -> None:
    """A router subscribing 300 ms after the request (as routers do after a broker restart)
    gets it: same request id, the timeout left, not marked as a resend of a dead router's."""
    subj = subject()
    seen: list[Any] = []

    async def later() -> None:
        await asyncio.sleep(0.3)

        async def on(msg: Any) -> None:
            seen.append(msg)
            await nc.publish(msg.reply, b'{"ok": true}')
        await nc.subscribe(subj, cb=on)
        await flush(nc)

    starter = asyncio.ensure_future(later())
    ex = exchange(nc, subj, no_router_grace_s=5.0, keepalive_s=None)  # no silence resends on a busy box
    t0 = time.monotonic()
    await ex.send()
    reply = await ex.next()
    waited = time.monotonic() - t0
    ex.close()
    await starter
    assert reply.data == b'{"ok": true}' and len(seen) == 1
    assert 0.3 <= waited < 3.0  # served once the router is there (a busy box may lag), not at the grace
    h = seen[0].headers
    assert h[subjects.H_REQUEST_ID] == "r1" and subjects.H_RESEND not in h
    assert int(h[subjects.H_TIMEOUT_MS]) <= 20000 - 300
    assert ex.resends == 0


async def test_no_router_ever_returns_the_status_after_the_grace(nc: Any) -> None:
    subj = subject()
    ex = exchange(nc, subj, no_router_grace_s=0.5, keepalive_s=None)
    t0 = time.monotonic()
    await ex.send()
    msg = await ex.next()
    waited = time.monotonic() - t0
    ex.close()
    assert msg.headers and msg.headers.get("Status") == "503" and not msg.data
    assert 0.5 <= waited < 1.5


async def test_the_request_timeout_caps_the_grace(nc: Any) -> None:
    subj = subject()
    ex = exchange(nc, subj, no_router_grace_s=10.0, timeout_s=0.3, wait_s=1.3, keepalive_s=None)
    t0 = time.monotonic()
    await ex.send()
    msg = await ex.next()
    waited = time.monotonic() - t0
    ex.close()
    assert msg.headers and msg.headers.get("Status") == "503"  # NO_HEALTHY_NODES, not a TIMEOUT
    assert 0.25 <= waited < 1.0


async def test_without_grace_no_responders_is_returned_at_once(nc: Any) -> None:
    ex = exchange(nc, subject())
    t0 = time.monotonic()
    await ex.send()
    msg = await ex.next()
    ex.close()
    assert msg.headers and msg.headers.get("Status") == "503" and time.monotonic() - t0 < 0.5


async def test_an_abort_ends_the_wait_for_a_router_at_once(nc: Any) -> None:
    """The HTTP client going away (or the broker connection lost) while the request waits for
    a router: the wait ends now, not at the grace."""
    class Gone(Exception):
        pass

    ex = exchange(nc, subject(), no_router_grace_s=30.0)
    await ex.send()
    asyncio.get_running_loop().call_later(0.2, ex.abort, Gone())
    t0 = time.monotonic()
    with pytest.raises(Gone):
        await ex.next()
    assert time.monotonic() - t0 < 1.0
    ex.close()


# --- the broker connection drops and comes back (issue 20 item 3) ------------------------------
# The reconnect is the connection's Link event (zmlcore.bus.link), fired here by the test: what
# the exchange does about it is the point (a real broker restart: tests/e2e/test_stream_broker_restart.py
# and the chaos suite).
async def test_a_reconnect_sends_the_request_again_and_a_close_aborts_it(nc: Any) -> None:
    from zmlcore.bus.link import Link

    subj = subject()

    async def script(msg: Any, attempt: int) -> None:
        if attempt == 1:  # its reply "lost in the outage": nothing more on this inbox
            await nc.publish(msg.reply, b"", headers=keepalive_headers())
            return
        await nc.publish(msg.reply, b'{"from": 2}')

    _, seen = await responder(nc, subj, script)
    link = Link()
    ex = exchange(nc, subj, keepalive_s=5.0)  # silence would take 15 s: the reconnect does it
    ex.follow(link, lambda: StreamInterruptedError("closed"))
    await ex.send()
    waiting = asyncio.ensure_future(ex.next())
    await asyncio.sleep(0.3)
    link.bump()  # the connection came back
    reply = await asyncio.wait_for(waiting, 5)
    assert reply.data == b'{"from": 2}' and len(seen) == 2 and ex.blinks == 1
    assert seen[1].headers[subjects.H_RESEND] == "1" and seen[1].reply != seen[0].reply
    assert subjects.H_RESUME not in seen[1].headers
    ex.close()
    # A connection closed for good ends the wait with what the caller gave.
    silent = subject()
    await responder(nc, silent, lambda msg, attempt: asyncio.sleep(0))  # takes it, says nothing
    ex2 = exchange(nc, silent, keepalive_s=5.0)
    ex2.follow(link, lambda: StreamInterruptedError("closed for good"))
    await ex2.send()
    waiting = asyncio.ensure_future(ex2.next())
    await asyncio.sleep(0.1)
    link.mark_closed()
    with pytest.raises(StreamInterruptedError, match="closed for good"):
        await asyncio.wait_for(waiting, 5)
    ex2.close()


async def test_a_reconnect_continues_a_stream_from_what_was_received(nc: Any) -> None:
    from zmlcore.bus.link import Link
    from zmlcore.reply import resume, streamframe

    subj = subject()
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"w1 "}}]}\n\n'

    async def script(msg: Any, attempt: int) -> None:
        if attempt == 1:
            await nc.publish(msg.reply, b'{"routing":{"node_id":"n1"}}',
                             headers={subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
            await nc.publish(msg.reply, streamframe.encode(1, chunk))
            return  # the rest lost in the outage
        r = resume.decode(msg.headers[subjects.H_RESUME])
        await nc.publish(msg.reply, streamframe.encode(r.seq + 1, chunk.replace(b"w1", b"w2")))
        await nc.publish(msg.reply, b"{}", headers={subjects.H_STREAM: "end", subjects.H_SEQ: str(r.seq + 2)})

    _, seen = await responder(nc, subj, script)
    link = Link()
    ex = exchange(nc, subj, keepalive_s=5.0, resume=True)
    ex.follow(link, lambda: StreamInterruptedError("closed"))
    await ex.send()
    assert (await ex.next()).headers[subjects.H_STREAM] == "start"
    assert (await ex.next()).data == streamframe.encode(1, chunk)
    waiting = asyncio.ensure_future(ex.next())
    await asyncio.sleep(0.2)
    link.bump()
    assert (await asyncio.wait_for(waiting, 5)).data.startswith(b"2\n")  # numbered on
    assert (await ex.next()).headers[subjects.H_STREAM] == "end"
    r = resume.decode(seen[1].headers[subjects.H_RESUME])
    assert (r.text, r.tokens, r.seq, r.node_id) == ("w1 ", 1, 1, "n1")
    ex.close()


async def test_a_followed_exchange_is_freed_by_reference_counting_alone(nc: Any) -> None:
    """Following the connection leaves no reference cycle: an exchange that made one per
    request (a re-registering closure) left every request's exchange, sink and stream record to
    the garbage collector, whose runs cost ~7% of the gateway's CPU per request
    (docs/benchmarks.md, "The gateway's share of issue 20's cost"). Stopped, it is no longer told."""
    import gc
    import weakref

    from zmlcore.bus.link import Link
    from zmlcore.reply import streamframe

    subj = subject()
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"w "}}]}\n\n'

    async def script(msg: Any, attempt: int) -> None:
        await nc.publish(msg.reply, b"{}", headers={subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
        await nc.publish(msg.reply, streamframe.encode(1, chunk))
        await nc.publish(msg.reply, streamframe.encode(2, chunk))
        await nc.publish(msg.reply, b"{}", headers={subjects.H_STREAM: "end", subjects.H_SEQ: "3"})

    await responder(nc, subj, script)
    link = Link()
    gc.collect()
    gc.disable()
    try:
        ex = exchange(nc, subj, keepalive_s=5.0, resume=True)
        ex.follow(link, lambda: StreamInterruptedError("closed"))
        await ex.send()
        kinds = []
        for _ in range(4):
            msg = await asyncio.wait_for(ex.next(), 5)
            kinds.append((msg.headers or {}).get(subjects.H_STREAM, "frame"))
        assert kinds == ["start", "frame", "frame", "end"] and ex.received is not None and ex.received.ended
        ex.close()
        link.bump()  # no longer followed: nothing is sent again
        assert ex.blinks == 0 and not ex._blinked
        gone = weakref.ref(ex)
        del ex, msg
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()


async def test_silence_while_the_connection_is_down_is_not_a_dead_router() -> None:
    from zmlcore.reply.keepalive import Silence

    w = Silence(1.0, now=0.0)
    assert w.gone(3.0)
    w.offline(3.0)
    assert not w.gone(5.9) and w.gone(6.0)
