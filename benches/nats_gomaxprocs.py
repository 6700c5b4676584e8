"""nats-server's CPU per request-reply under Go runtime settings, servers side by side.

One nats-server per variant (``unset``: Go's default, every core; ``g1``/``g2``: GOMAXPROCS=1/2;
``g1gc400``: GOMAXPROCS=1 and GOGC=400), started together; each rep runs the same load against
each in turn (interleaved): a requester and a responder (nats-py, this process) exchanging a
request with three headers and a ~160-byte body, a 400-byte reply and one completion event
fanned out to a subscriber, as the whole path does per request. Closed loop, C=1 then C=64.
nats-server's CPU is read from /proc/<pid>/task/*/schedstat (ns, every thread), so the Python
clients' own CPU is not in it:

    python benches/nats_gomaxprocs.py [--variants unset,g1,g2] [--reps 5]

Everything binds 127.0.0.1 on free ports; every server is started and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from typing import Any

import nats

from zmlcore.runtime.launch import Proc, free_port, start_nats

VARIANTS: dict[str, dict[str, str]] = {
    "unset": {}, "g1": {"GOMAXPROCS": "1"}, "g2": {"GOMAXPROCS": "2"},
    "g1gc400": {"GOMAXPROCS": "1", "GOGC": "400"},
}
HEADERS = {"Zml-A": "1", "Zml-B": "x" * 20, "Zml-C": "abc"}
BODY = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":16}' * 2


def run_ns(pid: int) -> int:
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that just ended
            pass
    return total


async def load(url: str, c: int, n: int) -> tuple[float, float]:
    """(wall seconds, median latency seconds) of n request-replies at concurrency c."""
    nc, rc = await nats.connect(url), await nats.connect(url)

    async def respond(msg: Any) -> None:
        await rc.publish("bench.done", b"{}" * 20)  # the completion event
        await msg.respond(b"x" * 400)

    async def ignore(msg: Any) -> None:
        pass

    await rc.subscribe("bench.req", queue="q", cb=respond)
    await nc.subscribe("bench.done", cb=ignore)
    await nc.flush()
    await rc.flush()
    for _ in range(200):  # warm-up
        await nc.request("bench.req", BODY, headers=HEADERS, timeout=5)
    left, lat = [n], []

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            t = time.perf_counter()
            await nc.request("bench.req", BODY, headers=HEADERS, timeout=5)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - t0
    await nc.close()
    await rc.close()
    return wall, statistics.median(lat)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="unset,g1,g2")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    names = a.variants.split(",")
    servers: dict[str, tuple[Proc, str]] = {}
    with tempfile.TemporaryDirectory(prefix="zml-gomaxprocs-") as tmp:
        try:
            for name in names:
                port = free_port()
                servers[name] = (start_nats("127.0.0.1", port, f"{tmp}/{name}", env=VARIANTS[name]),
                                 f"nats://127.0.0.1:{port}")
            res: dict[tuple[str, int], list[tuple[float, float, float]]] = {(nm, c): [] for nm in names for c in (1, 64)}
            for _ in range(a.reps):
                for c, n in ((1, 3000), (64, 20000)):
                    for name in names:
                        proc, url = servers[name]
                        before = run_ns(proc.pid)
                        wall, p50 = await load(url, c, n)
                        res[(name, c)].append(((run_ns(proc.pid) - before) / n / 1000, n / wall, p50 * 1e6))
            print(f"load average {os.getloadavg()[0]:.2f}; medians of {a.reps} reps")
            print("| variant | C | nats-server CPU us/request | per rep | req/s | p50 us |")
            print("|---|---|---|---|---|---|")
            for (name, c), rows in res.items():
                print(f"| {name} | {c} | {statistics.median(r[0] for r in rows):.1f} | "
                      f"{', '.join(f'{r[0]:.0f}' for r in rows)} | {statistics.median(r[1] for r in rows):.0f} | "
                      f"{statistics.median(r[2] for r in rows):.0f} |")
        finally:
            for proc, _ in servers.values():
                proc.stop()


if __name__ == "__main__":
    asyncio.run(main())
