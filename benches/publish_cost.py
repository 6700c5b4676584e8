#!/usr/bin/env python3
"""Client CPU per NATS publish: nats-py's ``Client.publish`` vs ``zmlcore.bus.publish.Publisher``,
against a real nats-server (started here on a free port, stopped by PID).

Each round publishes ``per`` messages (2 headers, ~200 B) and then lets the loop turn once, as a
service does when that many replies are due in one iteration; the two ways alternate round by
round (same minute, same neighbours). Reports the median over reps of process CPU per publish.

    python benches/publish_cost.py [--uvloop] [--per 1,4,64] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import nats

from zmlcore.runtime.launch import free_port, start_nats, wait_port
from zmlcore.bus.publish import Publisher

HEADERS = {"Zml-Stream": "events", "Zml-Seq": "12"}
DATA = b"data: " + b"x" * 200 + b"\n\n"


async def rounds(nc: nats.NATS, way: str, per: int, n: int) -> float:
    pub = Publisher.of(nc)
    t0 = time.process_time()
    for _ in range(n):
        for _ in range(per):
            if way == "nats-py":
                await nc.publish("bench.publish", DATA, headers=HEADERS)
            else:
                await pub.publish("bench.publish", DATA, headers=HEADERS)
        await asyncio.sleep(0)
    await nc.flush()
    return (time.process_time() - t0) / (n * per) * 1e6


async def main(a: argparse.Namespace) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="publish-cost-") as store:
        server = start_nats("127.0.0.1", port, store)
        try:
            wait_port("127.0.0.1", port, 10)
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            print(f"µs CPU per publish, medians of {a.reps} ({'uvloop' if a.uvloop else 'asyncio'})\n")
            print("| publishes per iteration | nats-py publish | Publisher |\n|---|---|---|")
            for per in (int(p) for p in a.per.split(",")):
                res: dict[str, list[float]] = {"nats-py": [], "Publisher": []}
                n = max(20000 // per, 400) if per == 1 else 80000 // per
                for _ in range(a.reps):
                    for way in res:
                        res[way].append(await rounds(nc, way, per, n))
                print(f"| {per} | {statistics.median(res['nats-py']):.2f} | {statistics.median(res['Publisher']):.2f} |")
            await nc.close()
        finally:
            server.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per", default="1,4,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.run(main(args))
    else:
        asyncio.run(main(args))
