"""Warmup: first-request TTFT after a quiet period, warmup on versus off.

Two MI300X `zml sim` nodes (vLLM API) serve model M; after each quiet period M is no longer
loaded (evicted while idle), then a burst of requests for M arrives. With warmup **off** the
first MODEL_NOT_LOADED answer triggers a load (`zml serve`, as an operator or autoscaler would)
and clients retry until served. With warmup **on** the warmup service saw the quiet window and
pre-loaded M (MI300X first, one node at a time) before the burst.

Everything is real except time: NATS, the health, warmup and router services (in-process), HTTP
to the sims; the sims run ``--time-scale`` times faster than real time, and the TTFTs below are
reported in model seconds (real seconds x time scale). TTFT is measured by the client: from
sending its first attempt to receiving a one-token completion (``max_tokens = 1``), retries
included.

    python benches/warmup_burst.py [--rounds 3] [--burst 32] [--time-scale 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import msgspec
import nats

from zml_health.service import HealthService
from zml_router.service import RouterService
from zml_warmup.service import WarmupService
from zmlcore import subjects
from zmlcore.config import parse_config
from zmlcore.runtime.launch import free_port, start_nats
from zmlcore.messages import ServeRequest
from zml_sim.server import SimNode

M = "meta-llama/llama-3-8b-instruct"
OTHER = "mistralai/mistral-7b-instruct"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def run_mode(warm: bool, *, rounds: int, burst: int, scale: float, nats_url: str) -> list[float]:
    sims = [SimNode(f"mi300x-{i}", "amd_mi300x", [OTHER], time_scale=scale) for i in (1, 2)]
    for s in sims:
        await s.start()
    # Production-like settings, divided by the time scale: polls every 5 s, quiet after 60 s.
    cfg = parse_config({
        "health": {"poll_interval_s": 5 / scale, "probe_timeout_s": 1.0, "startup_grace_s": 5.0},
        "warmup": {"enabled": warm, "sweep_interval_s": 5 / scale, "rate_window_s": 40 / scale,
                   "quiet_rps": 0.5 * scale, "quiet_min_s": 40 / scale, "max_concurrent_loads": 1},
        "router": {"stale_after_s": 15 / scale * 3},
        "models": {M: {"warm": True}},
        "nodes": [{"id": s.node_id, "accelerator": "amd_mi300x", "endpoint": s.url, "models": [OTHER, M]}
                  for s in sims],
    }, "bench")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    for bucket in (subjects.NODES_BUCKET, subjects.REGISTRY_BUCKET):
        try:
            await js.delete_key_value(bucket)
        except Exception:
            pass
    health, warmup, router = HealthService(cfg), WarmupService(cfg), RouterService(cfg, "bench-router")
    await health.start(nc)
    while not all(st.status == "up" for st in health.states.values()) or len(health.states) < 2:
        await asyncio.sleep(0.05)
    await warmup.start(nc)
    await router.start(nc)
    ttfts: list[float] = []
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(rounds):
                # Idle long enough for M to be evicted: unload it everywhere, then stay quiet.
                for s in sims:
                    await http.post(s.url + "/sim/unload", json={"model": M})
                await asyncio.sleep(120 / scale)  # the quiet period: 2 model-minutes
                ttfts += await burst_once(nc, burst, scale)
    finally:
        await router.stop()
        await warmup.stop()
        await health.stop()
        await nc.close()
        for s in sims:
            await s.stop()
    return ttfts


async def burst_once(nc: Any, n: int, scale: float) -> list[float]:
    triggered = asyncio.Event()
    body = json.dumps({"model": M, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}).encode()

    async def client(i: int) -> float:
        await asyncio.sleep(i * 0.5 / n)  # the burst arrives over half a real second
        t0 = time.monotonic()
        while True:
            msg = await nc.request(subjects.INFER, body, timeout=60)
            code = (msg.headers or {}).get(subjects.H_ERROR_CODE)
            if code is None:
                return (time.monotonic() - t0) * scale
            if code != "MODEL_NOT_LOADED":
                raise RuntimeError(f"unexpected {code}: {msg.data[:300]!r}")
            if not triggered.is_set():  # the first client to see it asks for a load, once
                triggered.set()
                await nc.request(subjects.WARMUP_SERVE, msgspec.json.encode(ServeRequest(model=M)), timeout=30)
            await asyncio.sleep(1.0 / scale)  # clients retry every model second

    return list(await asyncio.gather(*(client(i) for i in range(n))))


def summary(name: str, ttfts: list[float]) -> dict[str, Any]:
    return {"mode": name, "n": len(ttfts), "p50_s": round(pct(ttfts, 50), 2), "p99_s": round(pct(ttfts, 99), 2),
            "max_s": round(max(ttfts), 2), "mean_s": round(statistics.fmean(ttfts), 2)}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-bench-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            url = f"nats://127.0.0.1:{port}"
            out = []
            for warm in (False, True):
                ttfts = await run_mode(warm, rounds=args.rounds, burst=args.burst, scale=args.time_scale, nats_url=url)
                out.append(summary("warmup on" if warm else "warmup off", ttfts))
            return out
        finally:
            proc.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="quiet period + burst cycles per mode (default 3)")
    p.add_argument("--burst", type=int, default=32, help="requests per burst (default 32)")
    p.add_argument("--time-scale", type=float, default=40.0, help="sim speed-up (default 40)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    t0 = time.monotonic()
    rows = asyncio.run(main_async(args))
    print(f"{'mode':<12} {'n':>4} {'p50 (s)':>8} {'p99 (s)':>8} {'max (s)':>8}   (model seconds; "
          f"time scale {args.time_scale:g}, {time.monotonic() - t0:.0f} s real)")
    for r in rows:
        print(f"{r['mode']:<12} {r['n']:>4} {r['p50_s']:>8} {r['p99_s']:>8} {r['max_s']:>8}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
