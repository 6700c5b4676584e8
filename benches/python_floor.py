#!/usr/bin/env python3
"""What the same shape of path costs in Python with no ZML logic in it: the floor under ZML's
CPU per request on the peers harness (issue 29, docs/benchmarks.md).

Three minimal stacks on the same libraries ZML's services run on (uvicorn + httptools +
uvloop, nats-py, the same nats-server binary), each measured with wrk -t1 at C=1 and C=64
against the peers harness's stub (its CPU is not counted):

  http       uvicorn with a raw ASGI app that answers a fixed JSON body (one HTTP server: the
             gateway's part with nothing to do)
  http+nats  the same app sends each request body with nc.request() to a nats-py responder
             that answers it at once (gateway + broker + router, neither doing anything)
  http+nats+node  the responder calls the stub over HTTP (aiohttp, kept-alive connections) and
             answers with its reply: the whole shape of ZML's path, none of its decisions
  http+nats+node-raw  the same with the responder's node calls on a bare asyncio protocol and
             httptools (kept-alive), as ZML's router makes them: aiohttp's client costs more

CPU is read from /proc for every process of a stack (server, responder, nats-server), in ms
per request; run it beside benches/peers_path.py (same box, same minutes) to read ZML's numbers
against it.

    python benches/python_floor.py --harness ../shared/peers --conc 1,64 --seconds 6

Every process is started and stopped by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TCK = os.sysconf("SC_CLK_TCK")

APP = r'''
import asyncio, os, sys
import uvicorn, uvloop
BODY = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
HEAD = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
nats_url = os.environ.get("FLOOR_NATS")
nc = None

async def app(scope, receive, send):
    global nc
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if nats_url:
        if nc is None:
            import nats
            nc = await nats.connect(nats_url)
        reply = (await nc.request("floor.infer", body, timeout=30)).data
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})
        return
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": BODY})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning",
            access_log=False, lifespan="off")
'''

RESPONDER = r'''
import asyncio, os, sys
import nats, uvloop
node = os.environ.get("FLOOR_NODE")

class RawConn(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection parsed by httptools, as ZML's router's node client
    (zml_router.node.conn) is, with none of its bounds, timers or checks."""

    def __init__(self):
        import httptools
        self.new_parser = httptools.HttpResponseParser
        self.t = None
        self.fut = None
        self.body = []
        self.dead = False

    def connection_made(self, t):
        self.t = t

    def data_received(self, data):
        self.parser.feed_data(data)

    def on_body(self, b):
        self.body.append(b)

    def on_message_complete(self):
        self.fut.set_result(b"".join(self.body))

    def connection_lost(self, exc):
        self.dead = True
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError("closed"))

    def post(self, req):
        self.parser = self.new_parser(self)
        self.body = []
        self.fut = asyncio.get_running_loop().create_future()
        self.t.write(req)
        return self.fut


class RawClient:
    def __init__(self, url):
        from urllib.parse import urlsplit
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.head = ("POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                     "content-length: " % (u.path, u.hostname, u.port)).encode()
        self.idle = []

    async def post(self, body):
        conn = self.idle.pop() if self.idle else None
        if conn is None:
            _, conn = await asyncio.get_running_loop().create_connection(RawConn, self.host, self.port)
        data = await conn.post(b"".join((self.head, str(len(body)).encode(), b"\r\n\r\n", body)))
        if not conn.dead:
            self.idle.append(conn)
        return data

    async def close(self):
        for conn in self.idle:
            conn.t.close()
        self.idle = []


async def main():
    nc = await nats.connect(os.environ["FLOOR_NATS"])
    session = None
    if node and os.environ.get("FLOOR_CLIENT") == "raw":
        session = RawClient(node)
    elif node:
        import aiohttp
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))

    async def handle(msg):
        if session is None:
            await msg.respond(msg.data)
            return
        if isinstance(session, RawClient):
            await msg.respond(await session.post(msg.data))
            return
        async with session.post(node, data=msg.data, headers={"content-type": "application/json"}) as r:
            await msg.respond(await r.read())

    async def on_msg(msg):
        asyncio.ensure_future(handle(msg))  # as a router does: one task per request

    await nc.subscribe("floor.infer", queue="floor", cb=on_msg)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(15, stop.set)
    await stop.wait()
    await nc.close()
    if session is not None:
        await session.close()

uvloop.run(main())
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wrk(url: str, c: int, seconds: int, lua: str) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{c}", f"-d{seconds}s", "--timeout", "30s", "-s", lua, url],
                         capture_output=True, text=True, env=dict(os.environ, WRK_MODEL="stub-model", WRK_STREAM="0"))
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON"):
            return json.loads(line[len("WRKJSON"):])
    raise RuntimeError(out.stdout + out.stderr)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def run_stack(kind: str, harness: str, conc: list[int], seconds: int, work: str) -> list[dict]:
    from zmlcore.runtime.launch import nats_server_binary
    procs: list[subprocess.Popen] = []
    named: dict[str, int] = {}
    env = dict(os.environ)
    try:
        if kind != "http":
            nport = free_port()
            procs.append(subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(nport)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            named["nats"] = procs[-1].pid
            wait_port(nport)
            env["FLOOR_NATS"] = f"nats://127.0.0.1:{nport}"
            if kind.startswith("http+nats+node"):
                env["FLOOR_NODE"] = "http://127.0.0.1:8001/v1/chat/completions"
                env["FLOOR_CLIENT"] = "raw" if kind.endswith("-raw") else "aiohttp"
            procs.append(subprocess.Popen([sys.executable, os.path.join(work, "responder.py")], env=env))
            named["responder"] = procs[-1].pid
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, os.path.join(work, "app.py"), str(port)], env=env))
        named["server"] = procs[-1].pid
        wait_port(port)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        lua = os.path.join(harness, "post.lua")
        wrk(url, 8, 2, lua)  # warm-up (and the app's NATS connection)
        out = []
        for c in conc:
            t0 = {n: ticks(p) for n, p in named.items()}
            r = wrk(url, c, seconds, lua)
            t1 = {n: ticks(p) for n, p in named.items()}
            done = max(1, r["requests"])
            split = {n: round(1000.0 * (t1[n] - t0[n]) / TCK / done, 3) for n in named}
            out.append({"stack": kind, "concurrency": c, "rps": r["rps"], "p50_ms": r["p50_ms"],
                        "cpu_ms_per_req": round(sum(split.values()), 3), "split": split})
            print(json.dumps(out[-1]), flush=True)
        return out
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", default=os.path.join(HERE, "..", "..", "shared", "peers"))
    ap.add_argument("--conc", default="1,64")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--stacks", default="http,http+nats,http+nats+node,http+nats+node-raw")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zml-floor-")
    open(os.path.join(work, "app.py"), "w").write(APP)
    open(os.path.join(work, "responder.py"), "w").write(RESPONDER)
    stub = subprocess.Popen([sys.executable, os.path.join(a.harness, "stub_backend.py"), "--port", "8001"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(8001)
        rows = []
        for kind in a.stacks.split(","):
            rows += run_stack(kind, a.harness, [int(c) for c in a.conc.split(",")], a.seconds, work)
    finally:
        stop([stub])
    print("\n| stack | C | req/s | p50 ms | CPU ms/req (all its processes) | split |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %d | %.0f | %.2f | %.3f | %s |" % (r["stack"], r["concurrency"], r["rps"], r["p50_ms"],
                                                     r["cpu_ms_per_req"], ", ".join(f"{k} {v}" for k, v in r["split"].items())))


if __name__ == "__main__":
    main()
