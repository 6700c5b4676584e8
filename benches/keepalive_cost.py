#!/usr/bin/env python3
"""What router keepalives (``Zml-Keepalive``, docs/routing.md "Losing a replica") cost a
request that finishes within its interval: the fast path.

1. In-process: the router's per-request work for a request that asked (parse the header, add
   it to the book, mark each publish, remove it) and one tick of the keepalive task with N
   requests in flight, in microseconds.
2. Whole stack: CPU seconds of the router and gateway processes per request (from
   /proc/<pid>/stat) for the same load with ``[gateway] router_keepalive_ms = 0`` (nothing
   asked, the old router path; the gateway still reads replies through zmlcore.reply.exchange) and
   ``= 1000`` (the default). With ``--baseline DIR`` (a checkout of the code before keepalives,
   e.g. ``git archive <commit> | tar -x -C DIR``) that code is measured too, run from DIR's
   sources: the gateway's old ``nc.request()`` path.

    python benches/keepalive_cost.py [--requests 2000] [--conc 16] [--rounds 2] [--baseline DIR]

Every process is started and stopped by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from zmlcore.reply.keepalive import KeepaliveBook, parse_interval
from zmlcore.runtime.launch import free_port, service_argv, spawn, start_nats, wait_port

MODEL = "bench-model"


def micro(n: int = 200_000) -> dict[str, float]:
    book = KeepaliveBook()
    t = time.process_time()
    for i in range(n):
        reply = f"_INBOX.x.{i & 1023}"
        if (ka := parse_interval("1000")) is not None:
            book.add(reply, ka, 0.0)
        book.sent(reply, 0.1)  # the reply's publish
        book.remove(reply)
    per_request = (time.process_time() - t) / n
    for i in range(1000):
        book.add(f"_INBOX.y.{i}", 1.0, 0.0)
    t = time.process_time()
    for _ in range(1000):
        book.due(0.5)  # nothing due: the common tick
    tick_1000 = (time.process_time() - t) / 1000
    return {"router_per_request_us": per_request * 1e6, "tick_with_1000_in_flight_us": tick_1000 * 1e6}


def _toml(node_port: int, keepalive_ms: int | None) -> str:
    gateway = "" if keepalive_ms is None else f"[gateway]\nrouter_keepalive_ms = {keepalive_ms}\n"
    return f"""
[defaults]
request_timeout_s = 30
[health]
poll_interval_s = 1
{gateway}[[nodes]]
id = "sim-1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:{node_port}"
models = ["{MODEL}"]
[nodes.sim]
time_scale = 1000
load_time_s = 0.1
max_concurrency = 256
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(url: str, n: int, conc: int, stream_share: float) -> None:
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=conc)) as c:
        async def one(i: int) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "stream": (i % 100) < stream_share * 100}
            async with sem:
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.gather(*(one(i) for i in range(n)))


def stack_run(keepalive_ms: int | None, n: int, conc: int, src: str | None) -> dict[str, float]:
    env = {"PYTHONPATH": os.pathsep.join(f"{src}/{p}" for p in (
        "libs/zmlcore/src", "services/gateway/src", "services/router/src", "services/health/src", "sdk/src"))} if src else None
    with tempfile.TemporaryDirectory(prefix="zml-ka-bench-") as tmp:
        nats_port, node_port, gw_port = free_port(), free_port(), free_port()
        cfg = Path(tmp) / "zml.toml"
        cfg.write_text(_toml(node_port, keepalive_ms))
        url = f"nats://127.0.0.1:{nats_port}"
        procs = [start_nats("127.0.0.1", nats_port, f"{tmp}/nats")]
        try:
            for name in ("sim", "health", "router"):
                procs.append(spawn(name, service_argv(name, str(cfg), url), env=env))
            gw = spawn("gateway", service_argv("gateway", str(cfg), url, "--port", str(gw_port)), env=env)
            procs.append(gw)
            router = procs[3]
            assert wait_port("127.0.0.1", gw_port, 30), gw.tail()
            gateway = f"http://127.0.0.1:{gw_port}"
            deadline = time.monotonic() + 60
            while True:  # ready: a request succeeds
                try:
                    asyncio.run(_load(gateway, 1, 1, 0))
                    break
                except (AssertionError, httpx.HTTPError):
                    assert time.monotonic() < deadline, router.tail()
                    time.sleep(0.3)
            asyncio.run(_load(gateway, 300, conc, 0.5))  # warm-up
            r0, g0, t0 = _cpu_s(router.pid), _cpu_s(gw.pid), time.monotonic()
            asyncio.run(_load(gateway, n, conc, 0.5))
            wall = time.monotonic() - t0
            return {"router_us": (_cpu_s(router.pid) - r0) / n * 1e6, "gateway_us": (_cpu_s(gw.pid) - g0) / n * 1e6,
                    "rps": n / wall}
        finally:
            for p in reversed(procs):
                p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--conc", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="a checkout of the code before keepalives, to measure too")
    args = ap.parse_args()
    print("in-process:", {k: round(v, 2) for k, v in micro().items()})
    variants: list[tuple[str, int | None, str | None]] = [("keepalive off (0)", 0, None),
                                                          ("keepalive 1000 ms", 1000, None)]
    if args.baseline:
        variants.insert(0, ("before keepalives", None, args.baseline))  # its config has no such key
    results: dict[str, list[dict[str, float]]] = {v[0]: [] for v in variants}
    for _ in range(args.rounds):  # interleaved: the shared box's load drifts
        for name, ka, src in variants:
            results[name].append(stack_run(ka, args.requests, args.conc, src))
    print(f"| variant | router CPU µs/request | gateway CPU µs/request | req/s |  ({args.requests} requests, "
          f"half streamed, C={args.conc}, median of {args.rounds})")
    print("|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {med['router_us']:.0f} | {med['gateway_us']:.0f} | {med['rps']:.0f} |")


if __name__ == "__main__":
    main()
