#!/usr/bin/env python3
"""Routing between real llama.cpp nodes and sims at 80% load: latency vs round_robin, and do the
measured-speed estimates hold on a real engine?

Fleet: --real llama-server nodes (the tests' tiny generated llama, accelerator type `cpu`, one
thread each, --parallel 4) and two sims (`nvidia_a100`, `intel_gaudi2`, real time) serving the
same ZML model, with nats-server, health (0.5 s polls), one router and the gateway (the
zmlcore.runtime.launch helpers `zml up` uses). Steps:

1. Calibrate: a closed loop at the fleet's total slot count under round_robin for --calib
   seconds gives the fleet's capacity in requests/s for this workload.
2. For each policy: an open-loop Poisson load at --load x capacity for --window seconds
   (streaming chat, max_tokens lognormal median 48 clipped [8, 160], short prompts; the same
   seeded trace for both policies). TTFT is the first content chunk minus the scheduled arrival.
3. Estimates vs truth: after each cell, each real node's published speeds (prefill_tps,
   decode_tps, speeds_measured) are compared with the decode rate the client saw on that node
   (tokens after the first / time after the first token, batch-1-equivalent not applied: the
   client sees the batch the node ran).

    .venv/bin/python benches/real_engine_routing.py --window 60 --save $SCRATCH/real.json

Needs what the real-engine tests need (`.ci/llama-server`). Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
import llamaserver  # noqa: E402

from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, start_nats, wait_port  # noqa: E402

MODEL = "tiny/llama"
SERVED = "tiny-llama"
SIMS = [("a100-1", "nvidia_a100"), ("gaudi2-1", "intel_gaudi2")]


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def make_toml(real: dict[str, int], sims: dict[str, int], nats_url: str) -> str:
    out = [f'[nats]\nurl = "{nats_url}"\n', "[health]\npoll_interval_s = 0.5\nprobe_timeout_s = 2.0\n",
           "[defaults]\nrequest_timeout_s = 120\n"]
    for node_id, port in real.items():
        out.append(f'[[nodes]]\nid = "{node_id}"\naccelerator = "cpu"\nbackend = "llamacpp"\n'
                   f'endpoint = "http://127.0.0.1:{port}"\nmodels = ["{MODEL}"]\n'
                   f'[nodes.served_names]\n"{MODEL}" = "{SERVED}"\n')
    for (node_id, acc), port in zip(SIMS, sims.values()):
        out.append(f'[[nodes]]\nid = "{node_id}"\naccelerator = "{acc}"\nendpoint = "http://127.0.0.1:{port}"\n'
                   f'models = ["{MODEL}"]\n[nodes.sim]\ntime_scale = 1.0\nload_time_s = 0\n')
    return "\n".join(out)


async def one(sess: aiohttp.ClientSession, gw: str, policy: str, max_tokens: int, t_sched: float,
              rec: dict[str, Any]) -> None:
    body = {"model": MODEL, "policy": policy, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Tell me about request routing, please."}]}
    rec.update(sched=t_sched, ok=False, tokens=0)
    try:
        async with sess.post(gw + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"{resp.status} {(await resp.text())[:200]}"
                return
            rec["node"] = resp.headers.get("x-zml-node-id", "?")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    if (c.get("delta") or {}).get("content"):
                        now = time.monotonic()
                        rec.setdefault("first", now)
                        rec["last"] = now
                        rec["tokens"] += 1
            rec["ok"] = True
    except Exception as exc:  # the bench reports errors, it does not stop on them
        rec["error"] = repr(exc)


async def nodes(sess: aiohttp.ClientSession, gw: str) -> dict[str, dict[str, Any]]:
    async with sess.get(gw + "/v1/nodes") as r:
        return {n["node_id"]: n for n in (await r.json())["nodes"]}


async def calibrate(gw: str, slots: int, seconds: float) -> float:
    done = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as sess:
        async def worker(i: int) -> None:
            nonlocal done
            rng = np.random.default_rng(i)
            while time.monotonic() < stop:
                rec: dict[str, Any] = {}
                await one(sess, gw, "round_robin", int(np.clip(rng.lognormal(np.log(48), 0.6), 8, 160)),
                          time.monotonic(), rec)
                done += rec["ok"]
        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(slots)))
        return done / (time.monotonic() - t0)


async def cell(gw: str, policy: str, rate: float, window: float, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    n = int(rate * window)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    outs = np.clip(rng.lognormal(np.log(48), 0.6, n), 8, 160).astype(int)
    recs: list[dict[str, Any]] = [{} for _ in range(n)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as sess:
        t0 = time.monotonic()
        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
            tasks.append(asyncio.create_task(one(sess, gw, policy, int(outs[i]), t0 + arrivals[i], recs[i])))
        await asyncio.gather(*tasks)
        states = await nodes(sess, gw)
    ok = [r for r in recs if r.get("ok") and "first" in r]
    ttft = np.array([r["first"] - r["sched"] for r in ok])
    per_node: dict[str, dict[str, Any]] = {}
    for node_id in sorted({r.get("node", "?") for r in ok}):
        rs = [r for r in ok if r.get("node") == node_id]
        rates = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in rs if r["tokens"] > 8 and r["last"] > r["first"]]
        st = states.get(node_id, {})
        per_node[node_id] = {
            "requests": len(rs), "ttft_p50_s": round(float(np.median([r["first"] - r["sched"] for r in rs])), 3),
            "client_decode_tps_median": round(statistics.median(rates), 1) if rates else None,
            "published_prefill_tps": st.get("prefill_tps"), "published_decode_tps": st.get("decode_tps"),
            "speeds_measured": st.get("speeds_measured"),
        }
    return {"policy": policy, "rate_rps": round(rate, 3), "n": n, "ok": len(ok),
            "errors": [r.get("error") for r in recs if not r.get("ok")][:5],
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if len(ttft) else None,
            "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3) if len(ttft) else None,
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3) if len(ttft) else None,
            "nodes": per_node}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", type=int, default=2, help="real llama-server nodes")
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the calibrated capacity")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of arrivals per policy")
    ap.add_argument("--calib", type=float, default=20.0, help="calibration seconds")
    ap.add_argument("--policies", default="round_robin,latency")
    ap.add_argument("--save", help="write the results as JSON here")
    a = ap.parse_args()
    reason = llamaserver.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    binary, vocab = llamaserver.llama_server_binary(), llamaserver.vocab_file()
    assert binary and vocab
    model = llamaserver.cached_model(vocab)
    procs: list[Proc] = []
    tmp = tempfile.TemporaryDirectory(prefix="zml-real-bench-")
    try:
        nats_port = free_port()
        procs.append(start_nats("127.0.0.1", nats_port, tmp.name))
        nats_url = f"nats://127.0.0.1:{nats_port}"
        real = {f"llama-{i + 1}": free_port() for i in range(a.real)}
        for node_id, port in real.items():
            p = llamaserver.start_server(node_id, binary, model, port, alias=SERVED)
            procs.append(p)
            llamaserver.wait_healthy(f"http://127.0.0.1:{port}", p)
        sims = {node_id: free_port() for node_id, _ in SIMS}
        cfg = Path(tmp.name) / "zml.toml"
        cfg.write_text(make_toml(real, sims, nats_url))
        gw_port = free_port()
        procs.append(spawn("sim", service_argv("sim", str(cfg), nats_url)))
        procs.append(spawn("health", service_argv("health", str(cfg), nats_url)))
        procs.append(spawn("router", service_argv("router", str(cfg), nats_url)))
        procs.append(spawn("gateway", service_argv("gateway", str(cfg), nats_url, "--port", str(gw_port))))
        assert wait_port("127.0.0.1", gw_port, 30), "gateway did not start"
        gw = f"http://127.0.0.1:{gw_port}"

        async def ready() -> dict[str, dict[str, Any]]:
            async with aiohttp.ClientSession() as sess:
                for _ in range(300):
                    st = await nodes(sess, gw)
                    if len(st) == len(real) + len(SIMS) and all(n["status"] == "up" for n in st.values()):
                        return st
                    await asyncio.sleep(0.2)
            raise RuntimeError("fleet not up")

        states = asyncio.run(ready())
        slots = sum(n["max_concurrency"] for n in states.values())
        log(f"fleet up: {slots} slots; calibrating {a.calib:g} s")
        cap = asyncio.run(calibrate(gw, slots, a.calib))
        log(f"capacity {cap:.2f} req/s; cells at {a.load:.0%} = {cap * a.load:.2f} req/s")
        load1 = os.getloadavg()[0]
        results = []
        for policy in a.policies.split(","):
            r = asyncio.run(cell(gw, policy, cap * a.load, a.window, seed=1))
            log(json.dumps(r))
            results.append(r)
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
               "cpus": os.cpu_count(), "loadavg_at_start": round(load1, 2), "loadavg_at_end": round(os.getloadavg()[0], 2),
               "command": " ".join(sys.argv), "capacity_rps": round(cap, 3), "load": a.load, "cells": results}
        print(json.dumps(out, indent=2))
        if a.save:
            Path(a.save).write_text(json.dumps(out, indent=2) + "\n")
    finally:
        for p in reversed(procs):
            p.stop()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
