"""A request body over one NATS message, uploaded in parts (zmlcore.reply.exchange's side, and
the router's zml_router.request.uploads), on a real nats-server: the body arrives whole and in order,
it is uploaded again to the router that takes a resend when the first went silent after
taking it, and what is lost or too large is an error at once rather than a wait."""

from __future__ import annotations

import asyncio
import os

import nats
import pytest
from nats.aio.msg import Msg

from zmlcore import subjects
from zmlcore.errors import RequestTooLargeError, UploadIncompleteError
from zmlcore.reply.exchange import Exchange
from zmlcore.bus.publish import flush
from zml_router.request.uploads import Uploads, upload_size

SUBJECT = "test.upload.requests"


async def test_a_body_over_one_message_reaches_its_router_whole(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    router = await nats.connect(nats_url)
    uploads = Uploads("r-test")
    await uploads.start(router)
    body = os.urandom(3 * nc.max_payload + 12345)
    got: list[bytes] = []

    async def serve(msg: Msg) -> None:
        assert msg.data == b"" and msg.headers is not None
        size = upload_size(msg.headers, 64 << 20)
        assert size == len(body)
        got.append(await uploads.collect(msg.reply, size, 5.0))
        await router.publish(msg.reply, b"done")

    sub = await router.subscribe(SUBJECT, cb=serve)
    await flush(router)  # the request must find its subscriber, not 'no responders'
    try:
        ex = Exchange(nc, body, {subjects.H_REQUEST_ID: "u1"}, timeout_s=10, keepalive_s=None, subject=SUBJECT)
        assert ex.upload
        await ex.send()
        reply = await ex.next()
        ex.close()
        assert reply.data == b"done" and got == [body]
    finally:
        await sub.unsubscribe()
        await uploads.stop()
        await router.close()
        await nc.close()


async def test_a_router_silent_after_the_upload_is_replaced_and_the_body_sent_again(nats_url: str) -> None:
    """The first router takes the body and dies (no keepalive): the requester's resend goes to
    another router, which asks for the body again and answers."""
    nc = await nats.connect(nats_url)
    router = await nats.connect(nats_url)
    uploads = Uploads("r-dies")
    await uploads.start(router)
    body = os.urandom(2 * nc.max_payload)
    seen: list[tuple[str, int]] = []

    async def serve(msg: Msg) -> None:
        h = msg.headers or {}
        data = await uploads.collect(msg.reply, int(h[subjects.H_UPLOAD_BYTES]), 5.0)
        seen.append((h.get(subjects.H_RESEND, ""), len(data)))
        if not h.get(subjects.H_RESEND):
            return  # dies silently after the upload
        await router.publish(msg.reply, data[:16])

    sub = await router.subscribe(SUBJECT, cb=serve)
    await flush(router)  # the request must find its subscriber, not 'no responders'
    try:
        ex = Exchange(nc, body, {subjects.H_REQUEST_ID: "u2"}, timeout_s=20, keepalive_s=0.2, subject=SUBJECT)
        await ex.send()
        reply = await asyncio.wait_for(ex.next(), 10)
        ex.close()
        assert reply.data == body[:16]
        assert seen == [("", len(body)), ("1", len(body))]
    finally:
        await sub.unsubscribe()
        await uploads.stop()
        await router.close()
        await nc.close()


async def test_lost_parts_and_lies_are_errors_at_once(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    router = await nats.connect(nats_url)
    uploads = Uploads("r-lies")
    await uploads.start(router)
    try:
        async def ask(size: int, send: list[tuple[bytes, dict[str, str]]], first_s: float = 5.0) -> BaseException:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await flush(nc)  # subscribed before the router (another connection) asks
            task = asyncio.ensure_future(uploads.collect(inbox, size, first_s))
            to = (await sub.next_msg(timeout=5)).headers[subjects.H_UPLOAD_TO]  # type: ignore[index]
            assert to.startswith(subjects.upload("r-lies", ""))
            for data, h in send:
                await nc.publish(to, data, headers=h)
            with pytest.raises((UploadIncompleteError, RequestTooLargeError)) as info:
                await asyncio.wait_for(task, 15)
            await sub.unsubscribe()
            return info.value

        def part(k: int, n: int, data: bytes = b"x" * 10) -> tuple[bytes, dict[str, str]]:
            return data, {subjects.H_PART: str(k), subjects.H_PARTS: str(n)}

        err = await ask(30, [part(1, 3), part(3, 3)])
        assert isinstance(err, UploadIncompleteError) and err.retryable
        err = await ask(20, [part(1, 2, b"x" * 15), part(2, 2, b"x" * 15)])  # more than announced
        assert isinstance(err, RequestTooLargeError)
        err = await ask(30, [part(1, 2), part(2, 2)])  # less than announced
        assert isinstance(err, UploadIncompleteError) and "not the 30 announced" in err.message
        err = await ask(30, [], first_s=0.3)  # a requester that never sends
        assert isinstance(err, UploadIncompleteError) and "first part" in err.message
        # someone guessing at another router's uploads reaches nothing
        await nc.publish(subjects.upload("r-lies", "0" * 32), b"junk")
    finally:
        await uploads.stop()
        await router.close()
        await nc.close()
