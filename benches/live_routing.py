#!/usr/bin/env python3
"""Live routing: the reference comparison (round_robin vs latency, ...) on the real system.

Starts nats-server, health, router and gateway (zmlcore.runtime.launch helpers) and one sim process with
the reference fleet (2xH100, 1xA100, 2xMI300X, 1xGaudi2, 1xInferentia2; `[nodes.sim]` tables in a
temporary zml.toml, all at `--time-scale`), then drives an open-loop Poisson load at given
fractions of the fleet's capacity through the gateway with streaming chat requests (aiohttp), one
cell per (load, policy), the same arrival trace and lengths for every policy of a load (fixed
seed). Workload of shared/reference/routing-frontier.md: prompts lognormal(median 500, sigma 1.0)
clipped [16, 8192] tokens, sent as text of 4 chars/token (the sim's count); outputs
lognormal(median 200, sigma 0.8) clipped [1, 2048], sent as max_tokens. TTFT = first content
chunk at the client minus the request's *scheduled* arrival (client lag counts), reported in
virtual seconds (real x time_scale).

    python benches/live_routing.py --time-scale 4 --loads 50,80 \
        --policies round_robin,latency --window 90 --drain 30 --save $SCRATCH/live.json

Services run from a `git archive` snapshot of --zml-ref (default HEAD), like peers_path.py: other
engineers edit the working tree meanwhile. Health polls every 5 s / time_scale (the production
5 s in virtual time) unless --poll-s is given. The sim groups decode steps shorter than
`--min-step-s` real seconds into one chunk per sequence (exact virtual timing: a group never
crosses a sequence's end and an admission cuts it at the next step boundary); a larger grouping
than the sim's default 4 ms keeps the per-token chunk rate through gateway/router/NATS within
what 2 cores can carry. Every process is started and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "llama-3-8b"
FLEET = [
    ("h100-1", "nvidia_h100"), ("h100-2", "nvidia_h100"), ("a100-1", "nvidia_a100"),
    ("mi300x-1", "amd_mi300x"), ("mi300x-2", "amd_mi300x"), ("gaudi2-1", "intel_gaudi2"),
    ("inf2-1", "aws_inferentia2"),
]
TARGET_S = 0.5
WORDS = "the quick brown fox jumps over lazy dogs and then runs away from farmer john ".split()


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def snapshot(workdir: str, ref: str) -> tuple[str, str]:
    """`git archive` of REF into workdir/zml-src; returns (commit, PYTHONPATH)."""
    if ref == "worktree":
        root = REPO
        commit = "worktree(" + subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                                              text=True).stdout.strip() + "+dirty)"
    else:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", ref], capture_output=True, text=True,
                                check=True).stdout.strip()
        root = os.path.join(workdir, "zml-src")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        arch = subprocess.run(["git", "-C", REPO, "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=arch, check=True)
    dirs = sorted(glob.glob(os.path.join(root, "libs", "*", "src")) + glob.glob(os.path.join(root, "services", "*", "src")))
    return commit, os.pathsep.join(dirs)


def make_toml(ports: list[int], time_scale: float, poll_s: float) -> str:
    out = [
        "[defaults]", "request_timeout_s = 3600", "",
        "[health]", f"poll_interval_s = {poll_s:g}", "",
        f'[models."{MODEL}"]', "",
        # Health reports each sim's speeds x time_scale (real-time tok/s), so the router's TTFT
        # estimate is in real seconds; the targets of cost/balanced must shrink by the same factor
        # to mean 500 ms of virtual time (built-in names keep the real-time 500 ms).
        "[policies.cost_scaled]", 'strategy = "cost"', f"latency_target_ms = {500.0 / time_scale:g}", "",
        "[policies.balanced_scaled]", 'cost_priority = "balanced"', f"latency_target_ms = {500.0 / time_scale:g}", "",
    ]
    for (nid, acc), port in zip(FLEET, ports):
        out += ["[[nodes]]", f'id = "{nid}"', f'accelerator = "{acc}"', f'endpoint = "http://127.0.0.1:{port}"',
                f'models = ["{MODEL}"]', "[nodes.sim]", f"time_scale = {time_scale:g}", "load_time_s = 0.0",
                f"seed = {port}", ""]
    return "\n".join(out)


def capacity_rps(mean_p: float, mean_o: float) -> float:
    from zmlcore.fleet.perfmodel import SimProfile
    return sum(SimProfile.for_type(t).capacity_rps(mean_p, mean_o) for _, t in FLEET)


def make_trace(n: int, lam: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Virtual arrival times, prompt tokens, output tokens (Poisson, reference lengths)."""
    rng = np.random.default_rng(seed)
    P = np.clip(np.rint(rng.lognormal(math.log(500), 1.0, n)), 16, 8192).astype(int)
    O = np.clip(np.rint(rng.lognormal(math.log(200), 0.8, n)), 1, 2048).astype(int)
    t = np.cumsum(rng.exponential(1.0 / lam, n))
    return t, P, O


def prompt_text(tokens: int, i: int) -> str:
    """Exactly `tokens` tokens by the sim's count (ceil(len/4)): 4*tokens characters."""
    words = f"r{i} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(tokens))
    return words[: 4 * tokens].ljust(4 * tokens, "x")


# ---- CPU accounting -------------------------------------------------------------------------
def proc_cpu(pid: int) -> float:
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def machine_cpu() -> tuple[float, float]:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = v[3] + v[4]
    return float(sum(v)), float(idle)


# ---- one cell -------------------------------------------------------------------------------
async def one_request(sess: Any, url: str, i: int, body: bytes, t_sched: float, rec: dict[str, Any]) -> None:
    rec["sent"] = time.monotonic() - t_sched
    try:
        async with sess.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            rec["status"] = resp.status
            rec["node"] = resp.headers.get("x-zml-node-id")
            if resp.status != 200:
                rec["err"] = (await resp.text())[:200]
                return
            first = None
            tail = b""
            async for line in resp.content:
                if first is None:
                    if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                        first = time.monotonic()
                        rec["ttft"] = first - t_sched
                else:
                    tail = line
                if b"[DONE]" in line:
                    rec["done"] = time.monotonic() - t_sched
                    return
                if line.startswith(b'data: {"error'):
                    rec["err"] = line[:200].decode(errors="replace")
                    return
            rec["err"] = "stream ended without [DONE] " + tail[:80].decode(errors="replace")
    except asyncio.CancelledError:
        rec["cancelled"] = True
        raise
    except Exception as exc:  # noqa: BLE001
        rec["err"] = f"{type(exc).__name__}: {exc}"[:200]


async def fleet_state(sess: Any, ports: list[int]) -> list[dict[str, Any]]:
    out = []
    for port in ports:
        try:
            async with sess.get(f"http://127.0.0.1:{port}/sim/state") as r:
                out.append(await r.json())
        except Exception:  # noqa: BLE001
            out.append({})
    return out


async def ttft_hist(sess: Any, ports: list[int]) -> dict[float, float]:
    """Sum over nodes of the sims' vllm:time_to_first_token_seconds buckets (real seconds,
    node arrival -> first token: the node-side TTFT without gateway/router/NATS/client)."""
    out: dict[float, float] = {}
    for port in ports:
        try:
            async with sess.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        except Exception:  # noqa: BLE001
            continue
        for line in text.splitlines():
            if line.startswith("vllm:time_to_first_token_seconds_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[float(le)] = out.get(float(le), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def wait_idle(sess: Any, ports: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await fleet_state(sess, ports)
        if all(s and s["batch"]["running"] == 0 and s["queue"]["waiting"] == 0 for s in st):
            return True
        await asyncio.sleep(0.5)
    return False


async def run_cell(gw: str, ports: list[int], policy: str, trace: tuple[np.ndarray, np.ndarray, np.ndarray],
                   scale: float, window: float, drain: float, pids: dict[str, int]) -> dict[str, Any]:
    import aiohttp

    t_v, P, O = trace
    t_real = t_v / scale
    n = int(np.searchsorted(t_real, window))
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as sess, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as admin:
        if not await wait_idle(admin, ports, 120):
            log("fleet not idle after 120 s; starting anyway")
        bodies = [json.dumps({"model": MODEL, "policy": policy, "stream": True, "max_tokens": int(O[i]),
                              "messages": [{"role": "user", "content": prompt_text(int(P[i]), i)}]}).encode()
                  for i in range(n)]
        url = gw + "/v1/chat/completions"
        recs: list[dict[str, Any]] = [{} for _ in range(n)]
        tasks: list[asyncio.Task[None]] = []
        samples: list[tuple[float, list[tuple[int, int]]]] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                ts = time.monotonic() - t0
                st = await fleet_state(admin, ports)
                samples.append((ts, [(s.get("batch", {}).get("running", -1), s.get("queue", {}).get("waiting", -1))
                                     for s in st]))
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass

        h0 = await ttft_hist(admin, ports)
        cpu0 = {k: proc_cpu(p) for k, p in pids.items()}
        m0 = machine_cpu()
        t0 = time.monotonic()
        samp = asyncio.ensure_future(sampler())
        for i in range(n):
            d = t0 + t_real[i] - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.ensure_future(one_request(sess, url, i, bodies[i], t0 + t_real[i], recs[i])))
        t_end_arr = time.monotonic() - t0
        deadline = t0 + window + drain
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        left = [t for t in tasks if not t.done()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
        elapsed = time.monotonic() - t0
        cpu1 = {k: proc_cpu(p) for k, p in pids.items()}
        m1 = machine_cpu()
        stop.set()
        await samp
        h1 = await ttft_hist(admin, ports)
    busy = 100.0 * (1 - (m1[1] - m0[1]) / max(1.0, m1[0] - m0[0]))
    cpu = {k: round(100.0 * (cpu1[k] - cpu0[k]) / elapsed, 1) for k in pids}
    r = summarise(policy, recs, t_v[:n], scale, window, n, elapsed, t_end_arr, busy, cpu, samples, len(left))
    # node-side TTFT (all requests of the cell, incl. warm-up): cumulative share per bucket, virtual s
    tot = h1.get(math.inf, 0.0) - h0.get(math.inf, 0.0)
    r["node_ttft_cdf_v"] = {f"{le * scale:g}": round((h1[le] - h0.get(le, 0.0)) / tot, 4)
                            for le in sorted(h1) if tot > 0 and math.isfinite(le)}
    return r


def summarise(policy: str, recs: list[dict[str, Any]], t_v: np.ndarray, scale: float, window: float, n: int,
              elapsed: float, t_end_arr: float, busy: float, cpu: dict[str, float],
              samples: list[tuple[float, list[tuple[int, int]]]], n_cancelled: int) -> dict[str, Any]:
    warm = 0.1 * window * scale  # virtual seconds of warm-up excluded from TTFT statistics
    idx = [i for i in range(n) if t_v[i] >= warm]
    ttft = np.array([recs[i].get("ttft", math.inf) * scale for i in idx])  # no first token: censored (inf)
    errs = sum(1 for r in recs if r.get("err"))
    completed = sum(1 for r in recs if "done" in r)
    no_first = int(np.sum(~np.isfinite(ttft)))
    # throughput: completions inside [0.25 W, W] of real time, per virtual second
    lo, hi = 0.25 * window, window
    done_in = sum(1 for i, r in enumerate(recs) if "done" in r and lo <= t_v[i] / scale + r["done"] <= hi)
    thr_v = done_in / ((hi - lo) * scale)
    offered_v = n / (window * scale)
    nodes = Counter(r.get("node") or "none" for r in recs)
    lag = np.array([r["sent"] for r in recs if "sent" in r])
    err_kinds = Counter((r.get("err") or "")[:240] for r in recs if r.get("err"))
    per_node: dict[str, Any] = {}
    for j, (nid, _) in enumerate(FLEET):
        run = [s[1][j][0] for s in samples if s[1][j][0] >= 0]
        wait = [s[1][j][1] for s in samples if s[1][j][1] >= 0]
        per_node[nid] = {"share": nodes.get(nid, 0) / max(1, n), "mean_running": float(np.mean(run)) if run else -1,
                         "max_waiting": max(wait) if wait else -1,
                         "frac_waiting": float(np.mean([w > 0 for w in wait])) if wait else -1}
    fin = ttft[np.isfinite(ttft)]
    return {
        "policy": policy, "n": n, "stats_n": len(idx), "completed": completed, "errors": errs,
        "cancelled_at_end": n_cancelled, "no_first_token": no_first,
        "p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "max_finite": float(fin.max()) if len(fin) else math.inf,
        "share": float(np.mean(ttft <= TARGET_S)), "thr_v": thr_v, "offered_v": offered_v,
        "send_lag_p50_ms": float(np.percentile(lag, 50) * 1e3) if len(lag) else -1,
        "send_lag_p99_ms": float(np.percentile(lag, 99) * 1e3) if len(lag) else -1,
        "elapsed_s": elapsed, "arrivals_s": t_end_arr, "machine_busy_pct": busy, "cpu_pct": cpu,
        "nodes": per_node, "err_kinds": dict(err_kinds.most_common(4)),
        "ttft_v": [round(x, 4) if math.isfinite(x) else None for x in ttft.tolist()],
    }


def pct(x: np.ndarray, q: float) -> float:
    """Nearest-rank percentile; inf (censored: no first token before the cell ended) sorts last."""
    if len(x) == 0:
        return math.nan
    s = np.sort(x)
    return float(s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))])


# ---- orchestration --------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--loads", default="50,80", help="percent of fleet capacity")
    ap.add_argument("--policies", default="round_robin,latency")
    ap.add_argument("--window", type=float, default=90.0, help="real seconds of arrivals per cell")
    ap.add_argument("--drain", type=float, default=30.0, help="real seconds after the window before cancelling")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--poll-s", type=float, default=None, help="health poll (real s); default 5 / time_scale")
    ap.add_argument("--min-step-s", type=float, default=0.05, help="sim decode grouping threshold (real s)")
    ap.add_argument("--zml-ref", default="HEAD")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--save", default=None, help="write results JSON here")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()

    from zmlcore.runtime.launch import free_port, service_argv, spawn, start_nats, wait_port

    scale = a.time_scale
    poll_s = a.poll_s if a.poll_s is not None else 5.0 / scale
    workdir = a.workdir or tempfile.mkdtemp(prefix="zml-live-")
    os.makedirs(workdir, exist_ok=True)
    commit, pythonpath = snapshot(workdir, a.zml_ref)
    env = {"PYTHONPATH": pythonpath}
    ports = [free_port() for _ in FLEET]
    cfg = os.path.join(workdir, "zml.toml")
    open(cfg, "w").write(make_toml(ports, scale, poll_s))
    nats_port, gw_port = free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    log("workdir", workdir, "commit", commit, "time_scale", scale, "poll_s", poll_s)

    # capacity of the distribution actually sent (sample means of a large draw of the same law)
    _, Pbig, Obig = make_trace(200_000, 1.0, 12345)
    cap = capacity_rps(float(Pbig.mean()), float(Obig.mean()))
    log(f"fleet capacity {cap:.2f} req/s virtual (E[P]={Pbig.mean():.0f}, E[O]={Obig.mean():.0f})")

    procs = []
    results: list[dict[str, Any]] = []
    try:
        procs.append(start_nats("127.0.0.1", nats_port, os.path.join(workdir, "js"), echo=a.verbose))
        sim_code = ("import sys, zml_sim.engine as e; e.MIN_STEP_S = float(sys.argv[1]); "
                    "from zml_sim.cli import main; sys.exit(main(sys.argv[2:]))")
        sim = spawn("sim", [sys.executable, "-c", sim_code, str(a.min_step_s), "--config", cfg], env=env, echo=a.verbose)
        procs.append(sim)
        if not sim.wait_for("zml-sim ready", 60):
            raise RuntimeError("sim fleet did not start:\n" + sim.tail())
        procs.append(spawn("health", service_argv("health", cfg, nats_url), env=env, echo=a.verbose))
        procs.append(spawn("router", service_argv("router", cfg, nats_url, "--router-id", "router-1"), env=env,
                           echo=a.verbose))
        procs.append(spawn("gateway", service_argv("gateway", cfg, nats_url, "--host", "127.0.0.1", "--port",
                                                   str(gw_port)), env=env, echo=a.verbose))
        if not wait_port("127.0.0.1", gw_port, 30):
            raise RuntimeError("gateway did not start")
        gw = f"http://127.0.0.1:{gw_port}"
        pids = {p.name: p.pid for p in procs}
        pids["client"] = os.getpid()
        asyncio.run(ready(gw, poll_s))
        for load in [float(x) / 100 for x in a.loads.split(",")]:
            lam = load * cap
            n_max = int(lam * a.window * scale * 1.3) + 50
            trace = make_trace(n_max, lam, a.seed)
            for policy in a.policies.split(","):
                log(f"cell load={load:.0%} policy={policy}: {lam:.2f} req/s virtual = {lam * scale:.1f} req/s real")
                r = asyncio.run(run_cell(gw, ports, policy, trace, scale, a.window, a.drain, pids))
                r.update(load=load, capacity_v=cap, time_scale=scale, poll_s=poll_s, commit=commit)
                results.append(r)
                log(json.dumps({k: r[k] for k in ("p50", "p99", "share", "completed", "errors", "no_first_token",
                                                  "thr_v", "offered_v", "machine_busy_pct", "cpu_pct",
                                                  "send_lag_p99_ms")}))
                log("  node-side TTFT cdf (virtual s)", r.get("node_ttft_cdf_v"))
                log("  shares", {k: round(v["share"], 3) for k, v in r["nodes"].items()})
                if a.save:
                    json.dump(results, open(a.save, "w"), indent=1)
                for p in procs:
                    if not p.alive():
                        raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
    finally:
        for p in reversed(procs):
            with open(os.path.join(workdir, f"{p.name}.log"), "w") as f:
                f.write(p.tail(200) + "\n")
            p.stop()
    print_table(results)
    return 0


async def ready(gw: str, poll_s: float) -> None:
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + 60
    seen: set[str] = set()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline and len(seen) < len(FLEET):
            async with s.post(gw + "/v1/chat/completions", json={**body, "policy": "round_robin"}) as r:
                if r.status == 200:
                    seen.add(r.headers.get("x-zml-node-id", ""))
            await asyncio.sleep(0.05)
    log("nodes answering:", sorted(seen))
    await asyncio.sleep(2 * poll_s)


def fmt_s(x: float, bound: float = math.inf) -> str:
    if not math.isfinite(x):  # censored: no first token before the cell ended
        return f"> {bound:.0f} (censored)" if math.isfinite(bound) else "censored"
    return (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def print_table(results: list[dict[str, Any]]) -> None:
    print("| load | policy | n | TTFT p50 s | TTFT p99 s | <= 500 ms | completed | err | unfinished | "
          "throughput / offered (x capacity) | send lag p99 ms | machine busy % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        cap = r["capacity_v"]
        print(f"| {r['load']:.0%} | {r['policy']} | {r['n']} | {fmt_s(r['p50'])} | {fmt_s(r['p99'] if r['p99'] == r['p99'] else math.inf, r['max_finite'])} | "
              f"{r['share']:.1%} | {r['completed']} | {r['errors']} | {r['cancelled_at_end']} | "
              f"{r['thr_v'] / cap:.3f} / {r['offered_v'] / cap:.3f} | {r['send_lag_p99_ms']:.0f} | "
              f"{r['machine_busy_pct']:.0f} |")
    print()
    print("| load | policy | " + " | ".join(n for n, _ in FLEET) + " |")
    print("|---|---|" + "---|" * len(FLEET))
    for r in results:
        print(f"| {r['load']:.0%} | {r['policy']} | " + " | ".join(
            f"{r['nodes'][n]['share']:.1%} (max wait {r['nodes'][n]['max_waiting']})" for n, _ in FLEET) + " |")
    print()
    print("| load | policy | " + " | ".join(sorted(results[0]["cpu_pct"])) + " |" if results else "")
    for r in results:
        print(f"| {r['load']:.0%} | {r['policy']} | " + " | ".join(str(r["cpu_pct"][k]) for k in sorted(r["cpu_pct"])) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        print_table(json.load(open(sys.argv[2])))
        sys.exit(0)
    sys.exit(main())
