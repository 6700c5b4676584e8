"""zmlcore.bus.publish against a real nats-server: messages published through the Publisher and
through nc.publish on the same client arrive in the order they were made; across a broker
restart (published while disconnected: through nats-py's reconnect buffer); and with a pending
buffer far smaller than what is published (back-pressure, nothing lost, the buffer bounded)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats import errors

from zmlcore.runtime.launch import free_port, start_nats, wait_port
from zmlcore.bus.publish import Publisher, flush


@pytest.fixture()
async def nc(nats_url: str) -> AsyncIterator[Any]:
    c = await nats.connect(nats_url)
    yield c
    await c.close()


async def collect(nc: Any, subject: str) -> tuple[list[tuple[bytes, dict[str, str] | None]], Any]:
    got: list[tuple[bytes, dict[str, str] | None]] = []

    async def on(msg: Any) -> None:
        got.append((msg.data, msg.headers))
    sub = await nc.subscribe(subject, cb=on)
    await flush(nc)
    return got, sub


async def wait_for(cond: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


async def test_interleaved_with_nc_publish_in_order(nc: Any) -> None:
    got, _ = await collect(nc, "np.order")
    pub = Publisher.of(nc)
    rng = random.Random(7)
    sent = []
    for i in range(2000):
        data = str(i).encode()
        if rng.random() < 0.5:
            await pub.publish("np.order", data, headers={"Zml-Seq": str(i)} if i % 3 else None)
        else:
            await nc.publish("np.order", data)
        sent.append(data)
        if rng.random() < 0.2:
            await asyncio.sleep(0)  # some publishes alone in their iteration, most together
    await wait_for(lambda: len(got) == len(sent))
    assert [d for d, _ in got] == sent
    assert all(h == {"Zml-Seq": d.decode()} for d, h in got if int(d) % 3 and h is not None)


async def test_a_reply_published_in_the_iteration_of_the_subscribe_arrives(nc: Any) -> None:
    """A request inbox subscribed and the request published in the same iteration: the SUB
    (nats-py's) leaves before the request (ours), so the reply finds its subscriber."""
    async def echo(m: Any) -> None:
        await Publisher.of(nc).publish(m.reply, m.data)
    responder = await nc.subscribe("np.echo", cb=echo)
    await flush(nc)
    inbox = nc.new_inbox()
    got = asyncio.get_running_loop().create_future()

    async def on(msg: Any) -> None:
        if not got.done():
            got.set_result(msg.data)
    await nc.subscribe(inbox, cb=on)
    await Publisher.of(nc).publish("np.echo", b"ping", reply=inbox)
    assert await asyncio.wait_for(got, 5) == b"ping"
    await responder.unsubscribe()


async def test_bytes_leave_without_nats_py_flusher(nc: Any) -> None:
    """All publishes of one iteration go out in one write by the Publisher's callback: nats-py's
    flush queue is never used."""
    got, _ = await collect(nc, "np.burst")
    pub = Publisher.of(nc)
    for i in range(50):
        await pub.publish("np.burst", b"%d" % i)
    assert nc._flush_queue.empty() and len(nc._pending) == 50
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert nc._pending == [] and nc._pending_data_size == 0
    await wait_for(lambda: len(got) == 50)


async def test_hostile_subject_and_header_raise(nc: Any) -> None:
    pub = Publisher.of(nc)
    with pytest.raises(errors.BadSubjectError):
        await pub.publish("np.x\r\nPUB np.evil 0\r\n", b"")
    with pytest.raises(errors.BadSubjectError):
        await pub.publish("np.x", b"", reply="in box")
    with pytest.raises(errors.BadHeaderError):
        await pub.publish("np.x", b"", headers={"Bad\r\nKey": "v"})
    with pytest.raises(errors.MaxPayloadError):
        await pub.publish("np.x", b"x" * (nc.max_payload + 1))
    assert nc._pending == []  # nothing half-written
    got, _ = await collect(nc, "np.x")  # the connection still works
    await pub.publish("np.x", b"ok", headers={"A": "x\r\nB: y"})
    await wait_for(lambda: len(got) == 1)
    assert got[0] == (b"ok", {"A": "x  B: y"})


async def test_full_pending_buffer_is_bounded_and_loses_nothing(nats_url: str) -> None:
    c = await nats.connect(nats_url, pending_size=64 * 1024)
    try:
        got, _ = await collect(c, "np.full")
        pub = Publisher.of(c)
        chunk = b"x" * 16 * 1024
        peak = 0
        for i in range(600):  # ~10 MB, never yielding but for back-pressure
            await pub.publish("np.full", b"%06d" % i + chunk)
            peak = max(peak, c._pending_data_size)
        assert peak <= 64 * 1024 + len(chunk) + 200  # the bound, plus at most the message over it
        await wait_for(lambda: len(got) == 600, 30)
        assert [d[:6] for d, _ in got] == [b"%06d" % i for i in range(600)]
    finally:
        await c.close()


async def test_broker_restart_goes_through_nats_py_buffer() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-publish-") as store:
        server = start_nats("127.0.0.1", port, store)
        wait_port("127.0.0.1", port, 10)
        disconnected, reconnected = asyncio.Event(), asyncio.Event()

        async def on_dis() -> None:
            disconnected.set()

        async def on_re() -> None:
            reconnected.set()
        c = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                               disconnected_cb=on_dis, reconnected_cb=on_re)
        try:
            got, _ = await collect(c, "np.restart")  # the same client: re-subscribed before its buffer
            pub = Publisher.of(c)
            for i in range(10):
                await pub.publish("np.restart", b"%d" % i)
            await wait_for(lambda: len(got) == 10)
            server.stop()
            await asyncio.wait_for(disconnected.wait(), 10)
            assert not c.is_connected
            for i in range(10, 20):  # while disconnected: nats-py's reconnect buffer
                await pub.publish("np.restart", b"%d" % i, headers={"Zml-Seq": str(i)})
                await c.publish("np.restart", b"nc%d" % i)
            assert c._pending_data_size > 0
            server = start_nats("127.0.0.1", port, store)
            await asyncio.wait_for(reconnected.wait(), 15)
            for i in range(20, 25):
                await pub.publish("np.restart", b"%d" % i)
            want = [b"%d" % i for i in range(10)]
            want += [x for i in range(10, 20) for x in (b"%d" % i, b"nc%d" % i)]
            want += [b"%d" % i for i in range(20, 25)]
            await wait_for(lambda: len(got) >= len(want), 15)
            assert [d for d, _ in got] == want
        finally:
            await c.close()
            server.stop()


async def test_disconnected_buffer_full_raises_like_nats_py() -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-publish-") as store:
        server = start_nats("127.0.0.1", port, store)
        wait_port("127.0.0.1", port, 10)
        disconnected = asyncio.Event()

        async def on_dis() -> None:
            disconnected.set()
        c = await nats.connect(f"nats://127.0.0.1:{port}", max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                               pending_size=4096, disconnected_cb=on_dis)
        try:
            server.stop()
            await asyncio.wait_for(disconnected.wait(), 10)
            pub = Publisher.of(c)
            with pytest.raises(errors.OutboundBufferLimitError):
                for _ in range(100):
                    await pub.publish("np.gone", b"x" * 1000)
            assert c._pending_data_size <= 4096 + 1100
        finally:
            with contextlib.suppress(ConnectionResetError):  # nats-py's close drains a dead socket
                await c.close()


def test_under_uvloop_order_and_back_pressure(nats_url: str) -> None:
    """The services run on uvloop (zmlcore.runtime.runner): its transports must take the same path
    (write-buffer limits read, forced flush past pending_size, order kept)."""
    uvloop = pytest.importorskip("uvloop")

    async def go() -> None:
        c = await nats.connect(nats_url, pending_size=32 * 1024)
        try:
            got, _ = await collect(c, "np.uv")
            pub = Publisher.of(c)
            sent = []
            for i in range(400):
                data = b"%05d" % i + b"y" * (8192 if i % 2 else 10)
                sent.append(data)
                if i % 3:
                    await pub.publish("np.uv", data, headers={"I": str(i)})
                else:
                    await c.publish("np.uv", data)
                assert c._pending_data_size <= 32 * 1024 + 8192 + 200
            await wait_for(lambda: len(got) == len(sent), 30)
            assert [d for d, _ in got] == sent
        finally:
            await c.close()
    uvloop.run(go())


async def test_a_stalled_broker_blocks_publishers_with_bounded_buffers() -> None:
    """nats-server stopped (SIGSTOP): once the kernel's socket buffers are full, the transport's
    buffer stays under its high-water mark plus one batch, the pending list under pending_size
    plus one message, and publishers wait (back-pressure); resumed, everything arrives in order."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-publish-") as store:
        server = start_nats("127.0.0.1", port, store)
        wait_port("127.0.0.1", port, 10)
        pending_size = 256 * 1024
        c = await nats.connect(f"nats://127.0.0.1:{port}", pending_size=pending_size)
        try:
            got, _ = await collect(c, "np.stall")
            pub = Publisher.of(c)
            msg = b"z" * 32 * 1024
            n = 1500  # ~48 MB: more than loopback's socket buffers hold
            done = 0
            peak_transport = peak_pending = 0

            async def publish_all() -> None:
                nonlocal done, peak_pending, peak_transport
                sock = c._transport._io_writer.transport
                for i in range(n):
                    await pub.publish("np.stall", b"%06d" % i + msg)
                    done += 1
                    peak_pending = max(peak_pending, c._pending_data_size)
                    peak_transport = max(peak_transport, sock.get_write_buffer_size())
            server.popen.send_signal(signal.SIGSTOP)
            task = asyncio.create_task(publish_all())
            await asyncio.sleep(1.5)
            assert not task.done() and done < n  # blocked: nowhere for the bytes to go
            server.popen.send_signal(signal.SIGCONT)
            await asyncio.wait_for(task, 60)
            await wait_for(lambda: len(got) == n, 60)
            assert [d[:6] for d, _ in got] == [b"%06d" % i for i in range(n)]
            high = 64 * 1024  # asyncio's default high-water mark
            assert peak_pending <= pending_size + len(msg) + 200
            assert peak_transport <= high + pending_size + 2 * (len(msg) + 200)
        finally:
            server.popen.send_signal(signal.SIGCONT)
            await c.close()
            server.stop()


async def test_flush_means_the_broker_has_the_subscription(nats_url: str) -> None:
    """zmlcore.bus.publish.flush: once it returns, a message another connection publishes reaches
    the subscription made just before. nats-py 2.16's own ``nc.flush()`` writes its PING ahead of
    the buffered SUB, so its PONG can come back first and the message is dropped (this loop lost
    one within ~20 rounds with it)."""
    a = await nats.connect(nats_url)
    b = await nats.connect(nats_url)
    try:
        lost = 0
        for i in range(300):
            inbox = a.new_inbox()
            sub = await a.subscribe(inbox)
            await flush(a)
            await b.publish(inbox, str(i).encode())
            await b.flush()
            try:
                await sub.next_msg(timeout=0.5)
            except errors.TimeoutError:
                lost += 1
            await sub.unsubscribe()
        assert lost == 0
    finally:
        await a.close()
        await b.close()
