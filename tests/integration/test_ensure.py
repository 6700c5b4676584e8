"""JetStream assets opened or created on first use (zmlcore.bus.ensure) while JetStream cannot
answer yet: a service started against a cluster that is still electing its meta leader waits for
it instead of dying at start (a chaos run's health service did: its create timed out, and there was
then no bucket to open)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import NoStreamResponseError
from nats.js.kv import KeyValue

from zmlcore.bus.connect import connect
from zmlcore.bus.ensure import ensure, ensure_kv
from zmlcore.runtime.launch import ClusterPlan, Proc, free_port, nats_server_binary, spawn, start_nats, wait_port


@pytest.fixture
def cluster() -> Iterator[tuple[ClusterPlan, list[Proc]]]:
    """A 3-server cluster's plan, and the members the test started (stopped after it)."""
    with tempfile.TemporaryDirectory(prefix="zml-ensure-") as data:
        started: list[Proc] = []
        try:
            yield ClusterPlan.make("127.0.0.1", 3, data), started
        finally:
            for proc in started:
                proc.stop()


async def test_assets_wait_for_a_cluster_still_electing_its_leader(cluster: tuple[ClusterPlan, list[Proc]]) -> None:
    plan, started = cluster
    started.append(plan.start(0))  # one member of three: no quorum, no meta leader yet
    nc = await connect(plan.urls, "zml-test-ensure", replicas=3)
    try:
        js = nc.jetstream(timeout=1.0)  # the health service's timeout at a 0.5 s poll
        t0 = time.monotonic()
        kv_task = asyncio.create_task(ensure_kv(js, "zml_test_ensure"))
        stream_task = asyncio.create_task(ensure(
            lambda: js.stream_info("ZML_TEST_ENSURE"),
            lambda: js.add_stream(StreamConfig(name="ZML_TEST_ENSURE", subjects=["zml.test.ensure.>"],
                                               num_replicas=3)),
            "stream ZML_TEST_ENSURE"))
        await asyncio.sleep(2.5)  # every first attempt has failed by now
        assert not kv_task.done() and not stream_task.done()
        started.extend(plan.start(i) for i in (1, 2))
        kv = await asyncio.wait_for(kv_task, 20)
        await asyncio.wait_for(stream_task, 20)
        assert time.monotonic() - t0 > 2.5
        await _put_soon(kv, "k", b"v")
        assert (await kv.get("k")).value == b"v"
        for stream in ("ZML_TEST_ENSURE", "KV_zml_test_ensure"):
            assert (await js.stream_info(stream)).config.num_replicas == 3
    finally:
        await nc.close()


async def _put_soon(kv: KeyValue, key: str, value: bytes) -> None:
    """A stream just created in a cluster may not take writes on every server for a moment (the
    server we talk to has not set up its replica yet: "no responders"); services retry their
    writes (the health service at its next poll), and so does this."""
    deadline = time.monotonic() + 10
    while True:
        try:
            await kv.put(key, value)
            return
        except NoStreamResponseError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def test_concurrent_creators_all_open_the_same_bucket(nats_url: str) -> None:
    ncs = [await connect(nats_url, f"zml-test-ensure-{i}") for i in range(6)]
    try:
        kvs = await asyncio.gather(*(ensure_kv(nc.jetstream(), "zml_test_ensure_race", ttl=60) for nc in ncs))
        await kvs[0].put("k", b"1")
        assert [(await kv.get("k")).value for kv in kvs] == [b"1"] * len(kvs)
    finally:
        for nc in ncs:
            await nc.close()


async def test_a_create_that_cannot_succeed_fails_with_its_own_error_after_wait_s() -> None:
    """A lone server asked for 3 replicas: JetStream's refusal is raised (not "bucket not found"),
    after about ``wait_s``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-ensure-") as store:
        proc = start_nats("127.0.0.1", port, store)
        nc = await connect(f"nats://127.0.0.1:{port}", "zml-test-ensure", replicas=3)
        try:
            t0 = time.monotonic()
            with pytest.raises(Exception) as info:
                await ensure_kv(nc.jetstream(), "zml_test_ensure_r3", wait_s=1.0)
            waited = time.monotonic() - t0
            assert "replicas" in str(info.value).lower() or "resources" in str(info.value).lower(), info.value
            assert 0.5 < waited < 5.0
            t0 = time.monotonic()
            with pytest.raises(Exception):
                await ensure_kv(nc.jetstream(), "zml_test_ensure_r3", wait_s=0)
            assert time.monotonic() - t0 < 1.0
        finally:
            await nc.close()
            proc.stop()


# A service whose start needs a bucket, run by the shared runner (exit code and stderr).
SERVICE = """
import argparse, sys
from zmlcore.bus.ensure import ensure_kv
from zmlcore.runtime.runner import service_main

class NeedsBucket:
    async def start(self, nc):
        await ensure_kv(nc.jetstream(), "zml_test_ensure", wait_s=0.5)

    async def stop(self):
        pass

sys.exit(service_main("test", argparse.Namespace(config=None, nats_url=sys.argv[1]), lambda cfg, a: NeedsBucket()))
"""


def test_a_server_without_jetstream_is_one_clear_line_and_exit_3(tmp_path: Path) -> None:
    """A NATS server run without -js: the service says so in one line (no traceback) and exits 3,
    as for a connection closed for good (a supervisor restarts it)."""
    port = free_port()
    server = spawn("nats-no-js", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)])
    try:
        assert wait_port("127.0.0.1", port, 15), server.tail()
        run = subprocess.run([sys.executable, "-c", SERVICE, f"nats://127.0.0.1:{port}"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path)
        assert run.returncode == 3, run.stderr
        assert "zml test: JetStream does not answer at this NATS server (bucket zml_test_ensure: 503" in run.stderr
        assert "-js" in run.stderr and "Traceback" not in run.stderr, run.stderr
    finally:
        server.stop()
