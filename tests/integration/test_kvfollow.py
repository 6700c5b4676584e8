"""The one connection helper and KV follower against a real nats-server that is killed (-9) and
restarted: the watch is re-created with a fresh snapshot, keys deleted meanwhile are reported
deleted, and a connection closed for good ends the service with ConnectionClosed."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from test_health_helpers import eventually
from zmlcore.alive import BEAT_S
from zmlcore.alive import main as alive_main
from zmlcore.kvfollow import KVFollower, drop_watch, watch_bucket
from zmlcore.launch import Proc, free_port, spawn, nats_server_binary, start_nats, wait_port
from zmlcore.link import link_of, split_urls
from zmlcore.natsio import connect, ensure_kv
from zmlcore.runner import ConnectionClosed, run_service

BUCKET = "zml_test_follow"
T = TypeVar("T")


class Broker:
    """A nats-server on a fixed port and store that the test may kill -9 and start again."""

    def __init__(self, store: str) -> None:
        self.port = free_port()
        self.store = store
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, store: str | None = None) -> None:
        self.proc = start_nats("127.0.0.1", self.port, store or self.store)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.popen.kill()
        self.proc.popen.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


async def retry(fn: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
    """The writer's calls while JetStream comes back (the follower is what is under test)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await fn()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.fixture()
def broker() -> Iterator[Broker]:
    with tempfile.TemporaryDirectory(prefix="zml-follow-nats-") as store:
        b = Broker(store)
        b.start()
        try:
            yield b
        finally:
            b.stop()


def test_split_urls() -> None:
    assert split_urls("nats://a:1, nats://b:2,") == ["nats://a:1", "nats://b:2"]
    assert split_urls(["nats://a:1,nats://b:2", "nats://c:3"]) == ["nats://a:1", "nats://b:2", "nats://c:3"]
    with pytest.raises(ValueError):
        split_urls(" , ")


async def test_follower_survives_broker_kill_and_restart(broker: Broker) -> None:
    writer = await connect(broker.url, "writer")
    nc = await connect(broker.url, "follower")
    seen: dict[str, bytes] = {}
    deleted: list[str] = []
    follower = KVFollower(nc, BUCKET, on_put=seen.__setitem__,
                          on_delete=lambda k: (seen.pop(k, None), deleted.append(k)))
    task = asyncio.create_task(follower.run())
    try:
        kv = await ensure_kv(writer.jetstream(), BUCKET)
        await kv.put("a", b"1")
        await kv.put("b", b"1")
        assert await follower.wait_ready(5)
        await eventually(lambda: seen == {"a": b"1", "b": b"1"}, what="first values")

        broker.kill()
        broker.start()  # same port, same store: the bucket is still there
        back = time.monotonic()
        await eventually(lambda: writer.is_connected, what="writer reconnected")
        kv = await retry(lambda: ensure_kv(writer.jetstream(timeout=0.3), BUCKET))
        await retry(lambda: kv.put("c", b"2"))
        await retry(lambda: kv.delete("a"))
        written = time.monotonic() - back
        await eventually(lambda: seen == {"b": b"1", "c": b"2"}, timeout=10, what="updates after restart")
        took = time.monotonic() - back
        print(f"broker back -> writes accepted {written:.2f} s -> follower current {took:.2f} s")
        assert took < 2.0, f"updates flowed again only {took:.2f} s after the broker was back"
        assert follower.watches >= 2 and link_of(nc).generation >= 1

        # A broker that comes back without its store: the keys are gone, and the follower says so.
        broker.kill()
        with tempfile.TemporaryDirectory(prefix="zml-follow-empty-") as empty:
            broker.start(empty)
            await eventually(lambda: "b" in deleted and "c" in deleted and not seen, timeout=10,
                             what="deletes from the new snapshot")
            await eventually(lambda: writer.is_connected, what="writer reconnected")
            kv = await retry(lambda: ensure_kv(writer.jetstream(), BUCKET))
            await retry(lambda: kv.put("d", b"3"))
            await eventually(lambda: seen == {"d": b"3"}, timeout=10, what="updates on the new broker")
            broker.kill()
            broker.start()
    finally:
        task.cancel()
        for c in (nc, writer):
            await c.close()


async def test_follower_rewatches_when_its_consumer_is_lost(broker: Broker) -> None:
    """No reconnect, but the watch's consumer is gone (as when the cluster server holding it
    dies): the periodic check re-creates it."""
    nc = await connect(broker.url, "follower")
    seen: dict[str, bytes] = {}
    follower = KVFollower(nc, BUCKET, on_put=seen.__setitem__, on_delete=seen.pop, check_s=0.3)
    task = asyncio.create_task(follower.run())
    try:
        kv = await ensure_kv(nc.jetstream(), BUCKET)
        assert await follower.wait_ready(5)
        await kv.put("x", b"1")
        await eventually(lambda: seen.get("x") == b"1", what="first value")
        js = nc.jetstream()
        stream = f"KV_{BUCKET}"
        for info in await js.consumers_info(stream):
            await js.delete_consumer(stream, info.name)
        await eventually(lambda: follower.watches >= 2, timeout=5, what="re-watch")
        await kv.put("x", b"2")
        await eventually(lambda: seen.get("x") == b"2", timeout=5, what="update after re-watch")
    finally:
        task.cancel()
        await nc.close()



async def test_replaced_and_stopped_watch_consumers_do_not_pile_up(broker: Broker) -> None:
    """nats-py replaces an ordered consumer on a sequence gap or missed heartbeats and leaves the
    old one on the server; with its 5-minute default they piled up under load (soak). A watch's
    consumer goes once nobody listens to it, and a stopped watch deletes its consumer at once."""
    nc = await connect(broker.url, "follower")
    js = nc.jetstream()
    stream = f"KV_{BUCKET}"
    seen: dict[str, bytes] = {}
    follower = KVFollower(nc, BUCKET, on_put=seen.__setitem__, on_delete=seen.pop, inactive_s=1.0)
    task = asyncio.create_task(follower.run())
    try:
        kv = await ensure_kv(js, BUCKET)
        assert await follower.wait_ready(5)
        await kv.put("x", b"1")
        await eventually(lambda: seen.get("x") == b"1", what="first value")
        [first] = await js.consumers_info(stream)
        assert first.config.inactive_threshold == 1.0
        watcher = follower.watcher
        assert watcher is not None and watcher._sub is not None
        # What nats-py does on a gap: a new consumer, the old one's deliver subject unsubscribed.
        jsi = watcher._sub._sub._jsi
        await jsi.reset_ordered_consumer(jsi._sseq + 1)

        async def only_the_new_one() -> bool:
            names = [c.name for c in await js.consumers_info(stream)]
            return len(names) == 1 and names[0] != first.name
        await eventually(only_the_new_one, timeout=15, interval=0.2, what="the replaced consumer dropped")
        await kv.put("x", b"2")
        await eventually(lambda: seen.get("x") == b"2", what="updates through the new consumer")
        one_shot = await watch_bucket(kv)
        assert len(await js.consumers_info(stream)) == 2
        await drop_watch(one_shot)

        async def deleted() -> bool:  # at once, not after the inactive threshold (10 s)
            return len(await js.consumers_info(stream)) == 1
        await eventually(deleted, timeout=5, interval=0.1, what="the stopped watch's consumer deleted")
    finally:
        task.cancel()
        await nc.close()

def _small_broker(tmp: Path, max_payload: int) -> tuple[Proc, str]:
    port = free_port()
    conf = tmp / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:{port}\nmax_payload: {max_payload}\n")
    proc = spawn("nats-small", [nats_server_binary(), "-c", str(conf)])
    assert wait_port("127.0.0.1", port, 15), proc.tail()
    return proc, f"nats://127.0.0.1:{port}"


async def test_run_service_exits_when_the_connection_closes_for_good(tmp_path: Path) -> None:
    """A message whose payload fits max_payload but whose headers push it over: the server
    answers -ERR and closes the connection, and nats-py never reconnects. The runner must end."""
    proc, url = _small_broker(tmp_path, 4096)

    class Oversize:
        async def start(self, nc) -> None:  # type: ignore[no-untyped-def]
            await nc.publish("zml.test.big", b"x" * 4000, headers={"Zml-Request-Id": "r" * 500})

        async def stop(self) -> None:
            pass

    try:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(run_service(Oversize(), url, "zml-test"), 15)
    finally:
        proc.stop()


async def test_alive_file_beats_while_connected(broker: Broker, tmp_path: Path) -> None:
    alive = tmp_path / "alive"

    class Idle:
        async def start(self, nc) -> None:  # type: ignore[no-untyped-def]
            pass

        async def stop(self) -> None:
            pass

    task = asyncio.create_task(run_service(Idle(), broker.url, "zml-test", alive_file=str(alive)))
    try:
        await eventually(lambda: alive.exists(), what="first beat")
        first = alive.stat().st_mtime
        await eventually(lambda: alive.stat().st_mtime > first, timeout=6, what="second beat")
        assert alive_main([str(alive), "--max-age", "5"]) == 0
        assert alive_main([str(tmp_path / "never"), "--max-age", "5"]) == 1
        broker.kill()  # disconnected: no more beats
        await asyncio.sleep(0.5)
        stopped_at = alive.stat().st_mtime
        await asyncio.sleep(2 * BEAT_S + 0.5)
        assert alive.stat().st_mtime == stopped_at
        broker.start()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
