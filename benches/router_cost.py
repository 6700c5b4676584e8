#!/usr/bin/env python3
"""The router's own CPU per request, two or more ZML commits compared in one run.

The peers harness (benches/peers_path.py) measures the whole path (HTTP gateway -> NATS ->
router -> node); on a shared machine its throughput swings with the neighbours' load, and a
change of a few percent in one process disappears in it. This bench keeps only what the router
sees: a NATS client sends non-streamed requests to ``zml.infer`` with the headers the gateway
sets, at concurrency C, to one router (its own nats-server, health, and the harness's
stub_backend.py as the node), and reads the router's CPU ticks from /proc before and after.
Each rep runs every ref in turn (same minute, same neighbours); the report is the median over
reps of router (and nats-server) CPU microseconds per request.

    python benches/router_cost.py --refs a44eee4,HEAD --conc 1,64 --reps 5 --seconds 4

A ref may carry settings of the model's ``[models.stub-model]`` table after a ``+`` (several
joined by ``+``), to compare a switch in one run:

    python benches/router_cost.py --refs main,HEAD,HEAD+stream_from_nodes=false --conc 64

``--stub-delay-ms`` gives the node a service time (the stub's ``--delay-ms``), so that every
variant runs at the same request rate (C / delay) whatever the stub spends on its reply.

Every process is started by PID and stopped by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers_path  # noqa: E402  (snapshot: git archive of a ref)

from zmlcore.runtime.launch import free_port, nats_server_binary, wait_port  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")
BODY = json.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "Say hi in five words."}],
                   "max_tokens": 16}).encode()


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])  # utime + stime


def config(stub_port: int, model: list[str] | None = None) -> str:
    """The router's zml.toml; ``model``: ``key=value`` lines of ``[models.stub-model]``."""
    table = "[models.stub-model]\n" + "".join(f"{kv}\n" for kv in model) if model else ""
    return (f'[defaults]\nrequest_timeout_s = 30\n[health]\npoll_interval_s = 1\n{table}[[nodes]]\nid = "stub-1"\n'
            f'accelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:{stub_port}"\nbackend = "openai"\n'
            f'models = ["stub-model"]\n')


async def drive(url: str, conc: int, seconds: float, warm_s: float, router_pid: int, nats_pid: int
                ) -> tuple[int, float, float]:
    import nats

    from zmlcore import subjects

    nc = await nats.connect(url)
    n = 0
    errors = 0
    measuring = False
    kinds: dict[str, int] = {}

    async def worker(i: int) -> None:
        nonlocal n, errors
        k = 0
        while True:
            k += 1
            headers = {subjects.H_REQUEST_ID: f"b{i}-{k}", subjects.H_TIMEOUT_MS: "30000",
                       subjects.H_ACCEPT_ROUTING: subjects.ROUTING_IN_BODY, subjects.H_ID_GENERATED: "1"}
            try:
                msg = await nc.request(subjects.INFER, BODY, timeout=10, headers=headers)
                ok = not (msg.headers or {}).get(subjects.H_ERROR_CODE)
            except Exception as exc:
                ok = False
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.01)  # never spin: an error can come back without waiting
            if measuring:
                if ok:
                    n += 1
                else:
                    errors += 1

    tasks = [asyncio.ensure_future(worker(i)) for i in range(conc)]
    await asyncio.sleep(warm_s)
    r0, s0 = ticks(router_pid), ticks(nats_pid)
    measuring = True
    await asyncio.sleep(seconds)
    measuring = False
    r1, s1 = ticks(router_pid), ticks(nats_pid)
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=15)
    try:
        await asyncio.wait_for(nc.close(), 5)
    except Exception:
        pass
    if errors or kinds:
        print(f"  {errors} errors while measuring; exceptions: {kinds}", file=sys.stderr, flush=True)
    return n, (r1 - r0) / TCK, (s1 - s0) / TCK


def start_router(tmp: str, env: dict[str, str], procs: list[subprocess.Popen[bytes]], node_ports: list[int],
                 config_text: str, router_id: str) -> tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """nats-server (JetStream, its own store), then health and one router reading ``config_text``,
    once the nodes' ports answer; every process is appended to ``procs`` (:func:`stop` ends
    them). Returns the NATS URL, nats-server's and the router's processes."""
    nport = free_port()
    store = tempfile.mkdtemp(dir=tmp)
    nats_p = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd", store],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(nats_p)
    if not (wait_port("127.0.0.1", nport, 15) and all(wait_port("127.0.0.1", p, 15) for p in node_ports)):
        raise RuntimeError("nats-server or stub did not start")
    cfg = os.path.join(tmp, f"{router_id}_{nport}.toml")
    with open(cfg, "w") as f:
        f.write(config_text)
    url = f"nats://127.0.0.1:{nport}"
    log = open(os.path.join(tmp, f"services_{nport}.log"), "w")
    for mod, extra in (("zml_health", []), ("zml_router", ["--router-id", router_id])):
        procs.append(subprocess.Popen([sys.executable, "-m", mod, "--config", cfg, "--nats-url", url, *extra],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    return url, nats_p, procs[-1]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """End what :func:`start_router` and the caller started, newest first, by PID."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(8)
        except subprocess.TimeoutExpired:
            p.kill()


def snapshots(specs: list[str], tmp: str) -> dict[str, str]:
    """Each variant (``ref`` or ``ref+setting...``) -> the source path of its ref's snapshot
    (``peers_path.snapshot``: a git archive; 'worktree' = as checked out), one per ref."""
    paths: dict[str, str] = {}
    snaps: dict[str, str] = {}
    for spec in specs:
        ref = spec.split("+", 1)[0]
        if ref not in snaps:
            d = os.path.join(tmp, ref.replace("/", "_"))
            os.makedirs(d)
            commit, snaps[ref] = peers_path.snapshot(d, ref)
            print(f"{ref}: {commit}", flush=True)
        paths[spec] = snaps[ref]
    return paths


def one(pythonpath: str, stub: str, conc_levels: list[int], seconds: float, tmp: str,
        model: list[str] | None = None, stub_delay_ms: float = 0.0,
        warmup_s: float = 3.0) -> dict[int, tuple[float, float, float]]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    out: dict[int, tuple[float, float, float]] = {}
    try:
        stub_port = free_port()
        procs.append(subprocess.Popen([sys.executable, stub, "--port", str(stub_port), "--delay-ms", str(stub_delay_ms)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url, nats_p, router = start_router(tmp, env, procs, [stub_port], config(stub_port, model), "cost-r1")
        time.sleep(warmup_s)  # health polls the stub once, the router reads the node
        for c in conc_levels:
            n, router_s, nats_s = asyncio.run(asyncio.wait_for(drive(url, c, seconds, 1.0, router.pid, nats_p.pid),
                                                               seconds + 60))
            out[c] = (n / seconds, router_s / max(n, 1) * 1e6, nats_s / max(n, 1) * 1e6)
    finally:
        stop(procs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default="HEAD", help="comma-separated git refs ('worktree' = as checked out)")
    ap.add_argument("--conc", default="1,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--harness", default=os.path.join(HERE, "..", "..", "shared", "peers"),
                    help="the peers harness (its stub_backend.py is the node)")
    ap.add_argument("--warmup-s", type=float, default=3.0,
                    help="seconds between starting the services and measuring (more on a loaded box, where "
                         "3 s leaves the router unsubscribed: NoRespondersError)")
    ap.add_argument("--stub-delay-ms", type=float, default=0.0,
                    help="the stub's service time per request (its --delay-ms): at C / delay req/s every "
                         "variant runs at the same rate, so a variant whose node answers slower (an SSE body "
                         "costs the stub more than a JSON one) is not also one whose router batches less per "
                         "loop iteration")
    a = ap.parse_args()
    stub = os.path.join(a.harness, "stub_backend.py")
    if not os.path.exists(stub):
        sys.exit(f"no {stub}: pass --harness")
    conc = [int(c) for c in a.conc.split(",")]
    tmp = tempfile.mkdtemp(prefix="router_cost_")
    paths = snapshots(a.refs.split(","), tmp)
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    try:
        for rep in range(a.reps):
            for ref, pp in paths.items():
                for c, r in one(pp, stub, conc, a.seconds, tmp, ref.split("+")[1:], a.stub_delay_ms, a.warmup_s).items():
                    results.setdefault((ref, c), []).append(r)
                    print(f"rep {rep + 1} {ref:>12} C={c:<3} {r[0]:7.0f} req/s  router {r[1]:6.1f} us/req"
                          f"  nats {r[2]:5.1f} us/req", flush=True)
    finally:
        if not os.environ.get("ROUTER_COST_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n| ref | C | req/s | router CPU us/req | nats-server CPU us/req | reps |\n|---|---|---|---|---|---|")
    for (ref, c), rs in results.items():
        print(f"| {ref} | {c} | {statistics.median(r[0] for r in rs):.0f} | "
              f"{statistics.median(r[1] for r in rs):.1f} | {statistics.median(r[2] for r in rs):.1f} | {len(rs)} |")


if __name__ == "__main__":
    main()
