"""CPU per relayed stream chunk, all ZML processes (gateway + router + nats-server + health),
HTTP client -> gateway -> NATS -> router -> a streaming stub node.

The stub sends each SSE event in its own write, ``--gap-ms`` apart (as an engine sends one
token at a time). ``--pacing alone`` (default): each stream on its own clock, so every chunk
crosses every hop on its own (the worst case); ``--pacing steps``: one decode-step clock for
all streams, as a continuous-batching engine (vLLM, SGLang, TGI, llama.cpp with slots) emits
one token of every running sequence per step. Two phases with the same
requests and concurrency differ only in the number of chunks per stream (``--short`` and
``--long`` events); the CPU per chunk is the difference of the ZML processes' CPU divided by
the difference in chunks relayed, so the per-request cost (decision, dispatch, start/end
messages) cancels out:

    python benches/stream_chunk_cost.py [--conc 16] [--requests 400] [--short 2] [--long 66]
    python benches/stream_chunk_cost.py --conc 64 --gap-ms 15 --requests 256 --pacing steps

"net of idle" also subtracts what the processes burn with nothing to do (measured for
``--idle-s`` before each rep) over the long phase's extra time: at low chunk rates (one
stream) that background, not the chunks, is most of the raw figure.

CPU is read from /proc/<pid>/stat of each ZML process (utime + stime). The client (aiohttp,
this process) and the stub (its own process) are not counted. Everything binds 127.0.0.1 on
free ports; every process is started and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import aiohttp

from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, start_nats, wait_port

STUB = textwrap.dedent(r'''
    import asyncio, json, sys
    GAP = float(sys.argv[2]) / 1000.0
    STEPS = sys.argv[3] == "steps"
    waiting = []  # steps mode: the streams waiting for the next decode step
    async def step_clock():
        while True:
            await asyncio.sleep(GAP)
            ready = waiting[:]
            waiting.clear()
            for f in ready:
                if not f.done():
                    f.set_result(None)
    async def next_token():
        if not STEPS:
            await asyncio.sleep(GAP)
            return
        f = asyncio.get_running_loop().create_future()
        waiting.append(f)
        await f
    MODELS = b'{"object":"list","data":[{"id":"stub-model","object":"model","owned_by":"stub"}]}'
    def event(i, n):
        if i == n - 1:
            d = {"id": "c", "object": "chat.completion.chunk", "model": "stub-model", "choices": [],
                 "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
        else:
            d = {"id": "c", "object": "chat.completion.chunk", "model": "stub-model",
                 "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
        data = b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(data), data)
    async def handle(r, w):
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        n = int(line[15:])
                body = await r.readexactly(n) if n else b""
                if head.startswith(b"GET") and not head.startswith(b"GET /v1/models "):
                    w.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                if head.startswith(b"GET"):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                            % len(MODELS) + MODELS)
                    continue
                req = json.loads(body)
                if not req.get("stream"):
                    out = b'{"id":"c","object":"chat.completion","model":"stub-model","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                            % len(out) + out)
                    continue
                tokens = int(req.get("max_tokens") or 16)
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for i in range(tokens):
                    await next_token()
                    w.write(event(i, tokens))
                done = b"data: [DONE]\n\n"
                w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()
    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
        clock = asyncio.ensure_future(step_clock()) if STEPS else None
        await srv.serve_forever()
    asyncio.run(main())
''')

CONFIG = """
[defaults]
request_timeout_s = 60
[health]
poll_interval_s = 1
[[nodes]]
id = "stub-1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:{port}"
backend = "openai"
models = ["stub-model"]
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "stream": True}
    chunks = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        async for line in resp.content:
            if line.startswith(b"data: "):
                if line.strip() == b"data: [DONE]":
                    return chunks
                chunks += 1
    raise RuntimeError("stream ended without [DONE]")


async def phase(url: str, tokens: int, requests: int, conc: int, pids: dict[str, int]) -> tuple[int, dict[str, float], float]:
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one_stream(session, url, tokens) for _ in range(conc)))  # warm
        todo = list(range(requests))
        chunks = 0

        async def worker() -> None:
            nonlocal chunks
            while todo:
                todo.pop()
                got = await one_stream(session, url, tokens)  # not `chunks += await`: lost updates
                chunks += got

        before = {n: cpu_s(p) for n, p in pids.items()}
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.monotonic() - t0
        after = {n: cpu_s(p) for n, p in pids.items()}
    return chunks, {n: after[n] - before[n] for n in pids}, wall


async def idle_rate(pids: dict[str, int], seconds: float) -> float:
    """CPU seconds per second of the ZML processes with no request running (health polls,
    timers, nats-server's own housekeeping)."""
    before = sum(cpu_s(p) for p in pids.values())
    await asyncio.sleep(seconds)
    return (sum(cpu_s(p) for p in pids.values()) - before) / seconds


async def run(a: argparse.Namespace, url: str, pids: dict[str, int]) -> list[dict[str, float]]:
    rows = []
    for rep in range(a.reps):
        idle = await idle_rate(pids, a.idle_s)
        short = await phase(url, a.short, a.requests, a.conc, pids)
        long = await phase(url, a.long, a.requests, a.conc, pids)
        dchunks = long[0] - short[0]
        row = {n: (long[1][n] - short[1][n]) / dchunks * 1e6 for n in pids}
        row["total"] = sum(row.values())
        # The long phase lasts longer: what the processes burn idle in that extra time is not
        # the chunks' (it dominates at low chunk rates, e.g. one stream).
        row["net of idle"] = row["total"] - idle * (long[2] - short[2]) / dchunks * 1e6
        row["chunks/s"] = long[0] / long[2]
        rows.append(row)
        print(f"rep {rep + 1}: {short[0]} chunks in {short[2]:.1f} s, {long[0]} chunks in {long[2]:.1f} s ({row['chunks/s']:.0f}/s); "
              "µs CPU per chunk: " + ", ".join(f"{n} {row[n]:.1f}" for n in (*pids, "total", "net of idle")), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conc", type=int, default=16, help="streams at once")
    ap.add_argument("--requests", type=int, default=400, help="streams per phase")
    ap.add_argument("--short", type=int, default=2, help="chunks per stream, short phase")
    ap.add_argument("--long", type=int, default=66, help="chunks per stream, long phase")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="the stub's pause before each chunk")
    ap.add_argument("--pacing", choices=("alone", "steps"), default="alone",
                    help="alone: each stream sleeps --gap-ms before each token, on its own clock (every "
                         "event reaches the router alone); steps: one decode-step clock every --gap-ms for "
                         "all streams, as a continuous-batching engine emits a token of every running "
                         "sequence per step (still one write per event per stream)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=3.0,
                    help="seconds of idle CPU measured before each rep ('net of idle' subtracts it)")
    a = ap.parse_args()
    procs: list[Proc] = []
    stub = None
    with tempfile.TemporaryDirectory(prefix="zml-stream-bench-") as tmp:
        try:
            sport = free_port()
            stub = subprocess.Popen([sys.executable, "-c", STUB, str(sport), str(a.gap_ms), a.pacing])
            cfg = os.path.join(tmp, "zml.toml")
            with open(cfg, "w") as f:
                f.write(CONFIG.format(port=sport))
            nport = free_port()
            nats_url = f"nats://127.0.0.1:{nport}"
            procs.append(start_nats("127.0.0.1", nport, os.path.join(tmp, "js")))
            procs.append(spawn("health", service_argv("health", cfg, nats_url)))
            procs.append(spawn("router", service_argv("router", cfg, nats_url)))
            gport = free_port()
            procs.append(spawn("gateway", service_argv("gateway", cfg, nats_url, "--port", str(gport))))
            if not wait_port("127.0.0.1", gport, 30):
                raise RuntimeError("gateway did not start:\n" + procs[-1].tail())
            url = f"http://127.0.0.1:{gport}/v1/chat/completions"
            pids = {p.name: p.pid for p in procs}

            async def go() -> list[dict[str, float]]:
                deadline = time.monotonic() + 60
                while True:  # the node is routable once health has polled it
                    try:
                        async with aiohttp.ClientSession() as s:
                            await one_stream(s, url, 2)
                        break
                    except (AssertionError, aiohttp.ClientError):
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
                return await run(a, url, pids)

            rows = asyncio.run(go())
        finally:
            for p in reversed(procs):
                p.stop()
            if stub is not None:
                stub.terminate()
                stub.wait(10)
    names = [*(p.name for p in procs), "total", "net of idle"]
    print(f"\nmedians of {a.reps} reps, C={a.conc}, {a.short} vs {a.long} chunks per stream, stub gap {a.gap_ms:g} ms "
          f"({a.pacing}), load average {os.getloadavg()[0]:.1f}, "
          f"{statistics.median(r['chunks/s'] for r in rows):.0f} chunks/s in the long phase\n")
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    print("| " + " | ".join(f"{statistics.median(r[n] for r in rows):.1f}" for n in names) + " |  (µs CPU per relayed chunk)")


if __name__ == "__main__":
    main()
