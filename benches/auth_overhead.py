#!/usr/bin/env python3
"""What API keys and plan limits cost on the whole path (gateway -> NATS -> router -> stub),
measured with the shared peers harness's stub backend and load generator (../shared/peers:
stub_backend.py, load.py; read, not copied into this repo).

Gateways on one stack, measured in turn, interleaved over repetitions:
  open    no keys, no limits (the self-hosted default)
  static  a zml.toml key + [gateway] requests_per_minute (this replica's token bucket)
  plan    a run-time key (`zml keys create`) with a custom plan: the shared zml_limits KV entry,
          through this replica's leases (zmlcore.access.shares: about one compare-and-set per second)
  base    with --baseline REV: the same, on a gateway running REV's code (extracted with
          `git archive`, first on PYTHONPATH) with a key of its own: before/after in one run

Limits are set far above the offered load, so what is measured is the cost, not refusals.

    python benches/auth_overhead.py --conc 8,32 --reps 3 --requests 1500 [--baseline 85225e6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zmlcore.runtime.launch import free_port, service_argv, spawn, start_nats, wait_port

PEERS = os.environ.get("ZML_PEERS", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers"))

TOML = """\
[defaults]
request_timeout_s = 30
[health]
poll_interval_s = 1
[[nodes]]
id = "stub-1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:{stub}"
backend = "openai"
models = ["stub-model"]
"""


async def _make_key(url: str) -> str:
    import nats

    from zmlcore.access.apikeys import create_key
    from zmlcore.messages.keys import PlanLimits

    nc = await nats.connect(url)
    try:
        key, _ = await create_key(nc, plan="custom", name="bench",
                                  limits=PlanLimits(requests_per_minute=10_000_000, concurrent=100_000))
    finally:
        await nc.close()
    return key


def _load(url: str, key: str, conc: int, n: int, label: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(PEERS, "load.py"), "--url", url, "-c", str(conc),
                          "-n", str(n), "--max-seconds", "30", "--warmup", "100", "--api-key", key,
                          "--label", label], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", default="8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--baseline", default="", help="a git revision whose gateway is measured too (target 'base')")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="zml-auth-bench-")
    procs = []
    try:
        stub = free_port()
        procs.append(spawn("stub", [sys.executable, os.path.join(PEERS, "stub_backend.py"), "--port", str(stub)]))
        assert wait_port("127.0.0.1", stub, 20)
        base = TOML.format(stub=stub)
        static = '[gateway]\napi_keys = ["sk-bench"]\nrequests_per_minute = 10000000\nrequest_burst = 100000\n' + base
        # Two brokers, each with its own health and router: a run-time key turns keys on for every
        # gateway on its broker, and "open" must stay open.
        brokers = {}
        for b in ("A", "B"):
            port = free_port()
            brokers[b] = f"nats://127.0.0.1:{port}"
            procs.append(start_nats("127.0.0.1", port, os.path.join(tmp, "nats" + b)))
        paths = {"open": os.path.join(tmp, "open.toml"), "static": os.path.join(tmp, "static.toml")}
        for name, text in (("open", base), ("static", static)):
            with open(paths[name], "w") as f:
                f.write(text)
        for b, url_ in brokers.items():
            procs.append(spawn("health" + b, service_argv("health", paths["open"], url_)))
            procs.append(spawn("router" + b, service_argv("router", paths["open"], url_)))
        keys = {"open": "none", "static": "sk-bench", "plan": asyncio.run(_make_key(brokers["B"]))}
        targets = [("open", "open", "A", None), ("static", "static", "B", None), ("plan", "open", "B", None)]
        if a.baseline:
            src = os.path.join(tmp, "baseline")
            os.makedirs(src)
            root = Path(__file__).resolve().parent.parent
            tar = subprocess.run(["git", "-C", str(root), "archive", a.baseline, "libs", "services"],
                                 capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", src], input=tar, check=True)
            path = os.pathsep.join(os.path.join(src, p) for p in ("libs/zmlcore/src", "services/gateway/src"))
            keys["base"] = asyncio.run(_make_key(brokers["B"]))  # its own entry in zml_limits
            targets.append(("base", "open", "B", {"PYTHONPATH": path}))
        ports: dict[str, int] = {}
        for name, cfg, b, env in targets:
            ports[name] = free_port()
            procs.append(spawn("gw-" + name, service_argv("gateway", paths[cfg], brokers[b], "--port", str(ports[name])),
                               env=env))
            assert wait_port("127.0.0.1", ports[name], 30)
        time.sleep(3)  # first health polls
        results: dict[tuple[str, int], list[dict]] = {}
        for rep in range(a.reps):  # interleaved, so a busy spell hits every target alike
            for c in (int(c) for c in a.conc.split(",")):
                for name in keys:
                    run = _load(f"http://127.0.0.1:{ports[name]}/v1/chat/completions", keys[name], c, a.requests, name)
                    results.setdefault((name, c), []).append(run)
                    print(json.dumps(run), flush=True)
        print(f"{'target':8} {'C':>3} {'rps (median)':>13} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
        for (name, c), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(f"{name:8} {c:>3} {statistics.median(r['rps'] for r in runs):>13.1f} "
                  f"{statistics.median(r['p50_ms'] for r in runs):>8.2f} "
                  f"{statistics.median(r['p99_ms'] for r in runs):>8.2f} {sum(r['errors'] for r in runs):>7}")
        return 0
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
