"""What the saturation queue's heartbeat costs a router (zml_router.queue.jetstream: every held
entry's ``in_progress`` every ``KEEPALIVE_S``, so that ``ACK_WAIT_S`` can be 1 s): one process
holds N entries of a real JetStream work queue and keeps them alive for a while; its CPU time
(and nats-server's) per second, against the same process holding them without a heartbeat.

    python benches/queue_keepalive_cost.py --held 32,288 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import nats
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from zml_router.queue.jetstream import ACK_WAIT_S, KEEPALIVE_S
from zmlcore.runtime.launch import free_port, start_nats


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def hold(url: str, n: int, seconds: float, beat: bool, tag: str, server_pid: int) -> tuple[float, float]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = f"KA{tag}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"ka{tag}.>"], retention=RetentionPolicy.WORK_QUEUE))
    cfg = ConsumerConfig(durable_name="d", ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S if beat else 3600,
                         max_ack_pending=n + 1, filter_subject=f"ka{tag}.m")
    await js.add_consumer(stream, cfg)
    psub = await js.pull_subscribe(f"ka{tag}.m", durable="d", stream=stream)
    for i in range(n):
        await js.publish(f"ka{tag}.m", b"x" * 300)
    msgs = []
    while len(msgs) < n:
        msgs += await psub.fetch(n - len(msgs), timeout=5)
    c0, s0, t0 = time.process_time(), cpu_of(server_pid), time.monotonic()
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(KEEPALIVE_S)
        if beat:
            for m in msgs:
                await m.in_progress()
    elapsed = time.monotonic() - t0
    c1, s1 = time.process_time(), cpu_of(server_pid)
    redelivered = 0
    try:
        redelivered = len(await psub.fetch(n, timeout=0.2))
    except Exception:
        pass
    assert redelivered == 0, f"{redelivered} entries handed on while held"
    await nc.close()
    return (c1 - c0) / elapsed, (s1 - s0) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", default="32,288")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    port = free_port()
    broker = start_nats("127.0.0.1", port, tempfile.mkdtemp(prefix="ka-"))
    url = f"nats://127.0.0.1:{port}"
    try:
        print(f"load {os.getloadavg()[0]:.1f}; heartbeat every {KEEPALIVE_S} s, ack_wait {ACK_WAIT_S} s")
        for i, n in enumerate(int(x) for x in args.held.split(",")):
            for beat in (False, True):
                mine, server = asyncio.run(hold(url, n, args.seconds, beat, f"{i}{int(beat)}", broker.popen.pid))
                print(f"{n:4d} held, heartbeat {'on ' if beat else 'off'}: router-side CPU {mine * 100:5.2f}% of a core, "
                      f"nats-server {server * 100:5.2f}%", flush=True)
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
