#!/usr/bin/env python3
"""The whole path's CPU and added latency per request (HTTP gateway -> NATS -> router -> stub),
two or more ZML commits compared in one run, interleaved.

benches/peers_path.py measures the same path beside LiteLLM, but one target after the other
(minutes apart on a shared box) and on the fixed stub ports 8001/8002. Here every ref gets its
own stack at once (stub on a free port, nats-server, health, router, gateway), and each rep
runs ``direct`` (the load tool against a stub) and then every ref in turn at each C, with the
harness's own load tool (../shared/peers/load.py, aiohttp, closed loop). The CPU ticks of each
process are read from /proc before and after each window: per-process CPU per request, and
p50/p99 added over ``direct`` of the same rep.

    python benches/gateway_cost.py --refs c6efdf3,HEAD --conc 1,64 --reps 5 --seconds 4
    python benches/gateway_cost.py --refs worktree --hold   # one stack, up until Ctrl-C (profiling)

Needs the harness's venv (its python runs load.py: --harness-python, default the setup dir's
venv-harness). Every process is started by PID and stopped by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers_path  # noqa: E402  (snapshot: git archive of a ref)
from router_cost import config, ticks  # noqa: E402  (one stub-node config, /proc CPU ticks)

from zmlcore.runtime.launch import free_port, nats_server_binary, wait_port  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")
NAMES = ("gateway", "router", "nats", "health")


class Stack:
    """stub + nats-server + health + router + gateway of one ref, each by PID."""

    def __init__(self, ref: str, pythonpath: str, stub: str, hpy: str, tmp: str) -> None:
        self.ref = ref
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
        self.stub_port, nport, self.port = free_port(), free_port(), free_port()
        self.procs["stub"] = subprocess.Popen([hpy, stub, "--port", str(self.stub_port)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        store = tempfile.mkdtemp(dir=tmp)
        self.procs["nats"] = subprocess.Popen(
            [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd", store],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not (wait_port("127.0.0.1", nport, 15) and wait_port("127.0.0.1", self.stub_port, 15)):
            raise RuntimeError("nats-server or stub did not start")
        cfg = os.path.join(tmp, f"gateway_cost_{self.stub_port}.toml")
        with open(cfg, "w") as f:
            f.write(config(self.stub_port))
        url = f"nats://127.0.0.1:{nport}"
        self.log = os.path.join(tmp, f"services_{ref.replace('/', '_')}_{self.stub_port}.log")
        log = open(self.log, "w")
        for name, argv in (("health", ["-m", "zml_health"]), ("router", ["-m", "zml_router", "--router-id", "cost-r1"]),
                           ("gateway", ["-m", "zml_gateway", "--port", str(self.port)])):
            self.procs[name] = subprocess.Popen([sys.executable, *argv, "--config", cfg, "--nats-url", url],
                                                env=env, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        self.direct = f"http://127.0.0.1:{self.stub_port}/v1/chat/completions"

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def ticks(self) -> dict[str, int]:
        return {n: ticks(self.procs[n].pid) for n in NAMES}

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            if p.poll() is None:
                p.terminate()
        for p in reversed(list(self.procs.values())):
            try:
                p.wait(8)
            except subprocess.TimeoutExpired:
                p.kill()


def load(hpy: str, tool: str, url: str, conc: int, n: int, seconds: float, warmup: int) -> dict:
    r = subprocess.run([hpy, tool, "--url", url, "-c", str(conc), "-n", str(n), "--max-seconds", str(seconds),
                        "--warmup", str(warmup)], capture_output=True, text=True, timeout=seconds + 120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"load.py failed: {(r.stderr or r.stdout)[-500:]}") from None


def ready(hpy: str, tool: str, stack: Stack, timeout: float = 60) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if load(hpy, tool, stack.url, 1, 20, 5, 0).get("errors", 1) == 0:
                return
        except RuntimeError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{stack.ref}: no 200s through the gateway (log: {stack.log})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default="HEAD", help="comma-separated git refs ('worktree' = as checked out)")
    ap.add_argument("--conc", default="1,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0, help="each window's bound (load.py --max-seconds)")
    ap.add_argument("-n", type=int, default=1_000_000, help="requests per window (the time bound usually ends it)")
    ap.add_argument("--harness", default=os.path.join(HERE, "..", "..", "shared", "peers"),
                    help="the peers harness (stub_backend.py is the node, load.py the client)")
    ap.add_argument("--harness-python", help="python with aiohttp for load.py (default: the running one)")
    ap.add_argument("--hold", action="store_true", help="start the first ref's stack, print its PIDs, wait for Ctrl-C")
    a = ap.parse_args()
    stub, tool = os.path.join(a.harness, "stub_backend.py"), os.path.join(a.harness, "load.py")
    if not os.path.exists(stub):
        sys.exit(f"no {stub}: pass --harness")
    hpy = a.harness_python or sys.executable
    conc = [int(c) for c in a.conc.split(",")]
    tmp = tempfile.mkdtemp(prefix="gateway_cost_")
    stacks: list[Stack] = []
    try:
        for ref in a.refs.split(","):
            d = os.path.join(tmp, ref.replace("/", "_"))
            os.makedirs(d)
            commit, pp = peers_path.snapshot(d, ref)
            print(f"{ref}: {commit}", flush=True)
            stacks.append(Stack(ref, pp, stub, hpy, tmp))
            if a.hold:
                break
        for s in stacks:
            ready(hpy, tool, s)
        if a.hold:
            print(json.dumps({"url": stacks[0].url, "direct": stacks[0].direct, **stacks[0].pids()}), flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
            return
        rows: dict[tuple[str, int], list[dict]] = {}
        for rep in range(a.reps):
            for c in conc:
                d = load(hpy, tool, stacks[0].direct, c, a.n, a.seconds, 50)
                rows.setdefault(("direct", c), []).append(d)
                print(f"rep {rep + 1} {'direct':>12} C={c:<3} {d['rps']:7.0f} req/s p50 {d['p50_ms']:.3f} ms", flush=True)
                for s in stacks:
                    t0 = s.ticks()
                    r = load(hpy, tool, s.url, c, a.n, a.seconds, 50)
                    t1 = s.ticks()
                    done = max(1, r["ok"])
                    # load.py's window excludes its warm-up; ticks include it: count those requests too.
                    done += max(1, 50 // c) * c
                    r["cpu_us"] = {k: (t1[k] - t0[k]) / TCK / done * 1e6 for k in NAMES}
                    r["add_p50"] = r["p50_ms"] - d["p50_ms"]
                    r["add_p99"] = r["p99_ms"] - d["p99_ms"]
                    rows.setdefault((s.ref, c), []).append(r)
                    cpu = r["cpu_us"]
                    print(f"rep {rep + 1} {s.ref:>12} C={c:<3} {r['rps']:7.0f} req/s p50 {r['p50_ms']:.3f} ms "
                          f"(+{r['add_p50']:.3f}) CPU us/req " + " ".join(f"{k} {cpu[k]:.0f}" for k in NAMES)
                          + f" all {sum(cpu.values()):.0f}" + (f" errors {r['errors']}" if r.get("errors") else ""),
                          flush=True)
    finally:
        for s in stacks:
            s.stop()
        if not os.environ.get("GATEWAY_COST_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    print("\n| ref | C | req/s | p50 ms | +p50 ms | +p99 ms | " + " | ".join(f"{n} us" for n in NAMES)
          + " | all us/req | reps |\n|---|---|---|---|---|---|" + "---|" * len(NAMES) + "---|---|")
    for (ref, c), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] != "direct")):
        if ref == "direct":
            print(f"| direct | {c} | {med(r['rps'] for r in rs):.0f} | {med(r['p50_ms'] for r in rs):.3f} | | |"
                  + " |" * len(NAMES) + f" | {len(rs)} |")
            continue
        print(f"| {ref} | {c} | {med(r['rps'] for r in rs):.0f} | {med(r['p50_ms'] for r in rs):.3f} | "
              f"{med(r['add_p50'] for r in rs):.3f} | {med(r['add_p99'] for r in rs):.3f} | "
              + " | ".join(f"{med(r['cpu_us'][n] for r in rs):.0f}" for n in NAMES)
              + f" | {med(sum(r['cpu_us'].values()) for r in rs):.0f} | {len(rs)} |")


if __name__ == "__main__":
    main()
