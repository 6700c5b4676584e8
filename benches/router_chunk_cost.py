#!/usr/bin/env python3
"""The router's own CPU per relayed stream chunk, two or more ZML commits (or settings) in one run.

``benches/stream_chunk_cost.py`` measures every ZML process of the path for one checkout; this
one keeps only the router, as ``benches/router_cost.py`` does for plain requests: a NATS client
sends streamed chat requests to ``zml.infer`` with the headers the gateway sets (header-less
frames, keepalives, routing in the body), reads every reply message of each stream up to its
``end``, and reads the router's CPU ticks from /proc. Each variant is one router with its own
nats-server and health. Two phases differ only in the tokens per stream (``--short`` and
``--long``); the CPU per chunk is the difference of the router's CPU per stream divided by the
difference in tokens, so the per-request cost (decision, dispatch, start and end) cancels out.

The node (``--node``):

* ``peers``: the peers harness's ``stub_backend.py``, one process per phase (``--tokens``),
  which writes a stream's events in one write: what the router adds per event read, with no
  wake-up per token (the harshest ratio for per-event work).
* ``paced``: ``stream_chunk_cost.py``'s stub, one event per write, one decode-step clock every
  ``--gap-ms`` for all streams (``steps``), as a continuous-batching engine sends tokens: each
  token reaches the router in a read of its own and goes out in a publish of its own.

A variant is a ref (``worktree`` = as checked out) with settings after ``+``: ``key=value`` of
the model's ``[models.<model>]`` table, or ``request.key=value`` added to each request's body
(JSON value), e.g. the same code with continuation refused by the request::

    python benches/router_chunk_cost.py --harness ../shared/peers --node paced \\
        --refs 6f952c8,9363a57,main,worktree,worktree+request.continue_on_failure=false --rounds 5

Each round runs every variant in turn (same minute, same neighbours); the report is the median
over rounds, and each variant's per-round ratio to the first. Every process is started and
stopped by PID; everything binds 127.0.0.1.
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
from router_cost import snapshots, start_router, stop  # noqa: E402
from stream_chunk_cost import STUB as PACED_STUB  # noqa: E402

from zmlcore.runtime.launch import free_port  # noqa: E402

TCK = os.sysconf("SC_CLK_TCK")


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])  # utime + stime


def config(nodes: list[tuple[str, int, str]], model_table: list[str]) -> str:
    """zml.toml: ``nodes`` (id, port, model); ``model_table``: ``key=value`` lines for each model."""
    out = "[defaults]\nrequest_timeout_s = 30\n[health]\npoll_interval_s = 1\n"
    if model_table:
        for model in sorted({m for _, _, m in nodes}):
            out += f"[models.{model}]\n" + "".join(f"{kv}\n" for kv in model_table)
    for node_id, port, model in nodes:
        out += (f'[[nodes]]\nid = "{node_id}"\naccelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:{port}"\n'
                f'backend = "openai"\nmodels = ["{model}"]\n')
    return out


async def drive(url: str, model: str, tokens: int, extra: dict, conc: int, streams: int, router_pid: int
                ) -> tuple[int, int, float, float]:
    """``streams`` streams, ``conc`` at a time (after one warm stream per worker): (streams done,
    events received, router CPU seconds, wall seconds)."""
    import nats

    from zmlcore import subjects

    nc = await nats.connect(url)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hi in five words."}],
                       "max_tokens": tokens, "stream": True, **extra}).encode()
    waiting: dict[str, asyncio.Future[int]] = {}
    counts: dict[str, int] = {}

    async def on_msg(m) -> None:  # noqa: ANN001
        h = m.headers
        subj = m.subject
        if h is None:  # a header-less frame: "<seq>\n<events>"
            counts[subj] = counts.get(subj, 0) + m.data.count(b"data: ")
            return
        kind = h.get(subjects.H_STREAM)
        if kind in (subjects.STREAM_END, subjects.STREAM_ERROR) or h.get(subjects.H_ERROR_CODE):
            f = waiting.pop(subj, None)
            if f is not None and not f.done():
                if kind == subjects.STREAM_END:
                    f.set_result(counts.pop(subj, 0))
                else:
                    f.set_exception(RuntimeError(f"stream error {h.get(subjects.H_ERROR_CODE)}: {m.data[:200]!r}"))
        elif kind in (subjects.STREAM_CHUNK, subjects.STREAM_EVENTS):
            counts[subj] = counts.get(subj, 0) + m.data.count(b"data: ")

    prefix = f"_INBOX.rcc{os.getpid()}"
    await nc.subscribe(prefix + ".>", cb=on_msg)
    done = events = 0
    todo = streams

    async def one(i: int, k: int) -> int:
        subj = f"{prefix}.{i}.{k}.{time.monotonic_ns()}"
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiting[subj] = fut
        headers = {subjects.H_REQUEST_ID: f"s{i}-{k}", subjects.H_TIMEOUT_MS: "30000",
                   subjects.H_ACCEPT_ROUTING: subjects.ROUTING_IN_BODY, subjects.H_ID_GENERATED: "1",
                   subjects.H_ACCEPT_STREAM: subjects.STREAM_FRAMES, subjects.H_KEEPALIVE: "2000"}
        await nc.publish(subjects.INFER, body, reply=subj, headers=headers)
        try:
            return await asyncio.wait_for(fut, 30)
        finally:
            waiting.pop(subj, None)
            counts.pop(subj, None)

    async def worker(i: int) -> None:
        nonlocal done, events, todo
        k = 0
        while todo > 0:
            todo -= 1
            k += 1
            got = await one(i, k)  # not `events += await`: lost updates
            events += got
            done += 1

    deadline = time.monotonic() + 60
    while True:  # the node is routable once health has polled it and the router has read that
        try:
            await one(-1, 0)
            break
        except (RuntimeError, asyncio.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    await asyncio.gather(*(one(i, 0) for i in range(conc)))  # warm: one stream per worker
    r0, t0 = ticks(router_pid), time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(conc)))
    r1, t1 = ticks(router_pid), time.monotonic()
    await nc.close()
    return done, events, (r1 - r0) / TCK, t1 - t0


def variant_settings(spec: str) -> tuple[list[str], dict]:
    model_table, extra = [], {}
    for kv in spec.split("+")[1:]:
        key, _, val = kv.partition("=")
        if key.startswith("request."):
            extra[key[len("request."):]] = json.loads(val)
        else:
            model_table.append(kv)
    return model_table, extra


def one(pythonpath: str, a: argparse.Namespace, spec: str, tmp: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    model_table, extra = variant_settings(spec)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if a.node == "peers":
            stub = os.path.join(a.harness, "stub_backend.py")
            nodes = []
            for name, tokens in (("short", a.short), ("long", a.long)):
                port = free_port()
                procs.append(subprocess.Popen([sys.executable, stub, "--port", str(port), "--tokens", str(tokens),
                                               "--model", f"stub-{name}"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                nodes.append((f"stub-{name}", port, f"stub-{name}"))
            phases = [("stub-short", a.short), ("stub-long", a.long)]
        else:
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-c", PACED_STUB, str(port), str(a.gap_ms), "steps"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            nodes = [("stub-1", port, "stub-model")]
            phases = [("stub-model", a.short), ("stub-model", a.long)]
        url, _, router = start_router(tmp, env, procs, [p for _, p, _ in nodes], config(nodes, model_table),
                                      "chunk-r1")
        time.sleep(1.0)  # (drive waits until the router routes to the node)
        got = []
        for model, tokens in phases:
            got.append(asyncio.run(asyncio.wait_for(
                drive(url, model, tokens, extra, a.conc, a.streams, router.pid), 300)))
        (n0, e0, c0, w0), (n1, e1, c1, w1) = got
        per_stream = (c0 / n0 * 1e6, c1 / n1 * 1e6)
        return {"us_per_chunk": (per_stream[1] - per_stream[0]) / (a.long - a.short),
                "us_short": per_stream[0], "us_long": per_stream[1],
                "events_per_stream": e1 / n1, "chunks_per_s": e1 / w1}
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default="worktree",
                    help="comma-separated variants: a git ref ('worktree' = as checked out) with settings after +")
    ap.add_argument("--node", choices=("peers", "paced"), default="peers")
    ap.add_argument("--conc", type=int, default=64, help="streams at once")
    ap.add_argument("--streams", type=int, default=1000, help="streams per phase")
    ap.add_argument("--short", type=int, default=2, help="tokens per stream, short phase")
    ap.add_argument("--long", type=int, default=66, help="tokens per stream, long phase")
    ap.add_argument("--gap-ms", type=float, default=15.0, help="paced node: the decode step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--harness", default=os.path.join(HERE, "..", "..", "shared", "peers"),
                    help="the peers harness (its stub_backend.py is the peers node)")
    a = ap.parse_args()
    if a.node == "peers" and not os.path.exists(os.path.join(a.harness, "stub_backend.py")):
        sys.exit(f"no stub_backend.py in {a.harness}: pass --harness")
    tmp = tempfile.mkdtemp(prefix="router_chunk_cost_")
    specs = a.refs.split(",")
    paths = snapshots(specs, tmp)
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in specs}
    loads = []
    try:
        for rnd in range(a.rounds):
            loads.append(os.getloadavg()[0])
            for spec in specs:
                r = one(paths[spec], a, spec, tmp)
                rows[spec].append(r)
                print(f"round {rnd + 1} {spec:>40}: {r['us_per_chunk']:6.2f} us/chunk (per stream {r['us_short']:.0f}"
                      f" / {r['us_long']:.0f} us, {r['events_per_stream']:.1f} events, {r['chunks_per_s']:.0f}/s)"
                      f"  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if not os.environ.get("ROUTER_COST_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
    base = specs[0]
    print(f"\nnode {a.node}, C={a.conc}, {a.streams} streams per phase, {a.short} vs {a.long} tokens, "
          f"{a.rounds} rounds, load average at round starts {min(loads):.1f}-{max(loads):.1f}\n")
    print(f"| variant | router CPU µs per chunk (median) | per stream, {a.short} / {a.long} tokens | "
          f"per-round ratio to {base} (median; min-max) |\n|---|---|---|---|")
    for spec in specs:
        rs = rows[spec]
        ratios = [r["us_per_chunk"] / b["us_per_chunk"] for r, b in zip(rs, rows[base])]
        print(f"| {spec} | {statistics.median(r['us_per_chunk'] for r in rs):.2f} | "
              f"{statistics.median(r['us_short'] for r in rs):.0f} / {statistics.median(r['us_long'] for r in rs):.0f} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")


if __name__ == "__main__":
    main()
