"""A flush whose waiter gave up must not stop the connection's reader (nats-io/nats.py#914).

nats-py 2.16 answers each PONG by setting the first waiting flush's future; an abandoned flush
(timed out, or its task cancelled: a service stopped while confirming its subscriptions) leaves
its future cancelled, the PONG's set_result raises, and nats-py's read loop stops for good while
the client still says "connected". Seen in a CI run; real nats-server here, stopped with SIGSTOP
for the timeout case."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from zmlcore.bus.connect import connect
from zmlcore.bus.publish import flush
from zmlcore.runtime.launch import Proc, free_port, start_nats


@pytest.fixture
def broker() -> Iterator[tuple[Proc, int]]:
    """A nats-server of this test's own (it is paused), and its port."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-pong-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            yield proc, port
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.stop()


@pytest.fixture
async def nc(broker: tuple[Proc, int]) -> AsyncIterator[NATS]:
    conn = await connect(f"nats://127.0.0.1:{broker[1]}", "zml-test-pong")
    try:
        yield conn
    finally:
        await conn.close()


async def _still_reads(nc: NATS) -> None:
    """A request to a responder on the same connection: needs the reader."""
    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    sub = await nc.subscribe("zml.test.pong.echo", cb=echo)
    try:
        for i in range(3):
            reply = await nc.request("zml.test.pong.echo", str(i).encode(), timeout=2.0)
            assert reply.data == str(i).encode()
    finally:
        await sub.unsubscribe()


def _wait_stopped(pid: int) -> None:
    """SIGSTOP takes effect when the kernel next runs the process: until /proc says "T" it
    may still answer (seen: a PONG sent after kill() returned)."""
    deadline = time.monotonic() + 5
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "nats-server did not stop"
        time.sleep(0.001)


async def test_a_cancelled_flush_leaves_the_reader_running(nc: NATS) -> None:
    for _ in range(5):
        confirming = asyncio.ensure_future(flush(nc, 5))
        await asyncio.sleep(0)  # its PING is on its way
        confirming.cancel()
        await asyncio.gather(confirming, return_exceptions=True)
    await flush(nc, 2)  # the five PONGs came back and one more round trip works
    await _still_reads(nc)
    assert nc.is_connected


async def test_a_timed_out_flush_leaves_the_reader_running(broker: tuple[Proc, int], nc: NATS) -> None:
    pid = broker[0].pid
    os.kill(pid, signal.SIGSTOP)  # the broker answers nothing for a while
    try:
        _wait_stopped(pid)
        with pytest.raises(nats.errors.TimeoutError):
            await flush(nc, 0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    await _still_reads(nc)  # its late PONG came and went
    assert nc.is_connected
