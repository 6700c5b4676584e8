#!/usr/bin/env python3
"""CPU of the gateway's own code per request and per streamed chunk, refs compared in one run.

The whole-path benches (gateway_cost.py, stream_chunk_cost.py) measure every process over real
HTTP; on a shared box their noise (the same commit differs by 10-20% between two positions of
one rep) hides a change of a few percent in one process. Here the gateway's ASGI app is driven
in-process (no HTTP server, the ASGI calls uvicorn would make) against a real nats-server, with
a stand-in router in the same process that answers at once: one whole reply, or a stream of
``--chunks`` header-less frames between its start and end messages. The stand-in and nats-py
are the same code for every ref, so what differs between refs is the gateway's. Each round runs
every ref once, in alternating order; process CPU (``time.process_time``) per request.

    python benches/gateway_app_cost.py --refs 503742d,HEAD --rounds 10 -n 2000
    python benches/gateway_app_cost.py --refs worktree          # what is checked out
    python benches/gateway_app_cost.py --refs 9363a57,HEAD --instructions -n 600

``--instructions`` counts instructions instead (valgrind's cachegrind, no cache simulation): each
ref's child runs once with ``-n N/6`` and once with ``-n N`` requests after the same warm-up, and
the difference over the extra requests is the instructions per request. It is deterministic to
~0.5% whatever else the machine runs (CPU time on this shared box moves ±30% between rounds),
so a change of 1-2% shows; it counts work, not time (cache misses and memory are not in it).

Each ref runs from a ``git archive`` of it (benches/peers_path.snapshot) through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIG = ('[[nodes]]\nid = "n1"\naccelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:9"\n'
          'backend = "openai"\nmodels = ["m"]\n')
EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,'
         b'"delta":{"content":" tok"},"finish_reason":null}]}\n\n')


def child(url: str, mode: str, n: int, chunks: int, config: str) -> None:
    """One ref's measurement (run with that ref's PYTHONPATH): prints one JSON line."""
    import asyncio

    import msgspec
    import nats

    import zml_gateway
    from zmlcore import subjects
    from zmlcore.config import load_config
    from zmlcore.messages import RoutingInfo, StreamStart
    from zml_gateway.app import Gateway

    info = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="balanced",
                       queue_depth_at_dispatch=0, decision_id="d", request_id="r")
    reply = (b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],'
             b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4},"zml":'
             + msgspec.json.encode(info) + b"}")
    start = msgspec.json.encode(StreamStart(routing=info))

    class Cycle:  # what uvicorn's cycle offers the app (zml_gateway.protocol.FastCycle)
        body_complete = True

        def __init__(self, body: bytes) -> None:
            self.body = body

        async def receive(self) -> dict:  # type: ignore[type-arg]
            return {"type": "http.request", "body": self.body, "more_body": False}

        def on_disconnect(self, callback: object) -> object:
            return lambda: None

    async def main() -> None:
        nc = await nats.connect(url)
        rnc = await nats.connect(url)

        async def router(msg: object) -> None:
            to = msg.reply  # type: ignore[attr-defined]
            if mode == "once":
                await rnc.publish(to, reply)
                return
            await rnc.publish(to, start, headers={subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
            for i in range(1, chunks + 1):
                await rnc.publish(to, b"%d\n" % i + EVENT)
            await rnc.publish(to, b'{"usage":{"total_tokens":44}}',
                              headers={subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(chunks + 1)})

        await rnc.subscribe(subjects.FRONT_DOOR_INFER, cb=router)
        await rnc.flush()
        app = Gateway(load_config(config, env={}), nc, {})
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}],
                           "stream": mode == "stream"}).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-length", str(len(body)).encode())], "client": ("127.0.0.1", 1)}
        out: list[dict] = []  # type: ignore[type-arg]

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            out.append(message)

        async def one() -> None:
            out.clear()
            await app(scope, Cycle(body).receive, send)
            if out[0].get("status") != 200:
                raise RuntimeError(f"not a 200: {out[:2]}")

        for _ in range(200):  # warm-up
            await one()
        t0 = time.process_time()
        for _ in range(n):
            await one()
        cpu_us = (time.process_time() - t0) / n * 1e6
        print(json.dumps({"src": zml_gateway.__file__, "us": cpu_us}))
        await nc.close()
        await rnc.close()

    try:
        import uvloop  # as the gateway runs
        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs", default="HEAD", help="comma-separated git refs ('worktree' = as checked out)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("-n", type=int, default=2000, help="requests per measurement")
    ap.add_argument("--chunks", type=int, default=40, help="chunks per stream")
    ap.add_argument("--instructions", action="store_true",
                    help="count instructions under valgrind (deterministic) instead of CPU time")
    ap.add_argument("--child", nargs=2, metavar=("URL", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.n, a.chunks, a.config)
        return
    sys.path.insert(0, HERE)
    import peers_path  # noqa: E402  (snapshot: git archive of a ref)

    from zmlcore.runtime.launch import free_port, start_nats

    refs = a.refs.split(",")
    tmp = tempfile.mkdtemp(prefix="gateway_app_cost_")
    config = os.path.join(tmp, "zml.toml")
    with open(config, "w") as f:
        f.write(CONFIG)
    paths = {}
    for i, ref in enumerate(refs):
        d = os.path.join(tmp, f"ref{i}")
        os.makedirs(d)
        commit, paths[ref] = peers_path.snapshot(d, ref)
        print(f"{ref}: {commit}", flush=True)
    port = free_port()
    nats_proc = start_nats("127.0.0.1", port, os.path.join(tmp, "js"))
    if a.instructions:
        try:
            instructions(refs, paths, f"nats://127.0.0.1:{port}", config, a.n, a.chunks, tmp)
        finally:
            nats_proc.stop()
        return
    res: dict[tuple[str, str], list[float]] = {}
    loads = []
    try:
        for rnd in range(a.rounds):
            loads.append(os.getloadavg()[0])
            order = refs if rnd % 2 == 0 else refs[::-1]
            for mode in ("once", "stream"):
                for ref in order:
                    r = subprocess.run(
                        [sys.executable, os.path.abspath(__file__), "--child", f"nats://127.0.0.1:{port}", mode,
                         "-n", str(a.n), "--chunks", str(a.chunks), "--config", config],
                        env={**os.environ, "PYTHONPATH": paths[ref]}, capture_output=True, text=True)
                    if r.returncode:
                        raise RuntimeError(f"{ref} {mode}: {r.stderr[-2000:]}")
                    d = json.loads(r.stdout.strip().splitlines()[-1])
                    res.setdefault((ref, mode), []).append(d["us"])
            print(f"round {rnd + 1}: " + " ".join(f"{ref} {mode} {v[-1]:.1f}" for (ref, mode), v in res.items()),
                  flush=True)
    finally:
        nats_proc.stop()
    med = statistics.median
    print(f"\nload average at each round: {', '.join(f'{x:.1f}' for x in loads)}")
    print(f"\n| ref | µs CPU / request | µs CPU / stream ({a.chunks} chunks) | per chunk: (stream - request) / chunks | "
          f"per-round ratio to {refs[0]} (request, stream) |\n|---|---|---|---|---|")
    for ref in refs:
        once, stream = res[(ref, "once")], res[(ref, "stream")]
        ratio = ""
        if ref != refs[0]:
            r1 = med(x / y for x, y in zip(once, res[(refs[0], "once")]))
            r2 = med(x / y for x, y in zip(stream, res[(refs[0], "stream")]))
            ratio = f"{r1:.3f}, {r2:.3f}"
        print(f"| {ref} | {med(once):.1f} | {med(stream):.1f} | {(med(stream) - med(once)) / a.chunks:.2f} | {ratio} |")


def instructions(refs: list[str], paths: dict[str, str], url: str, config: str, n: int, chunks: int,
                 tmp: str) -> None:
    """Instructions per request and per stream of each ref (see the module doc): two runs of
    the child under cachegrind, ``n // 6`` and ``n`` requests, the difference per request."""
    lo = max(1, n // 6)
    res: dict[tuple[str, str], float] = {}
    for ref in refs:
        for mode in ("once", "stream"):
            counts = []
            for k in (lo, n):
                r = subprocess.run(
                    ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                     f"--cachegrind-out-file={os.path.join(tmp, 'cachegrind.out')}", sys.executable,
                     os.path.abspath(__file__), "--child", url, mode, "-n", str(k), "--chunks", str(chunks),
                     "--config", config],
                    env={**os.environ, "PYTHONPATH": paths[ref]}, capture_output=True, text=True)
                found = [line for line in r.stderr.splitlines() if "I   refs:" in line or "I    refs:" in line]
                if r.returncode or not found:
                    raise RuntimeError(f"{ref} {mode} under valgrind: {r.stderr[-2000:]}")
                counts.append(int(found[-1].split(":")[1].replace(",", "")))
            res[(ref, mode)] = (counts[1] - counts[0]) / (n - lo)
            print(f"{ref} {mode}: {res[(ref, mode)]:,.0f} instructions", flush=True)
    print(f"\n| ref | instructions / request | instructions / stream ({chunks} chunks) | per chunk: (stream - request) "
          f"/ chunks | ratio to {refs[0]} (request, stream, per chunk) |\n|---|---|---|---|---|")
    base = refs[0]
    for ref in refs:
        once, stream = res[(ref, "once")], res[(ref, "stream")]
        chunk = (stream - once) / chunks
        ratio = ""
        if ref != base:
            b_once, b_stream = res[(base, "once")], res[(base, "stream")]
            ratio = f"{once / b_once:.3f}, {stream / b_stream:.3f}, {chunk / ((b_stream - b_once) / chunks):.3f}"
        print(f"| {ref} | {once:,.0f} | {stream:,.0f} | {chunk:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
