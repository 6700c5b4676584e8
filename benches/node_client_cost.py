"""CPU per call of the router's node client (zml_router.node.dispatch over zml_router.node.client)
against aiohttp called directly (the router's client before it), on one loop, in the same run,
against a stub node in another process (so its CPU is not counted).

    python benches/node_client_cost.py [--calls 4000] [--reps 3]

Prints CPU µs per call (this process only) per rep and the medians: non-streamed at C=1 and
C=32 (a ~400-byte JSON reply), and streamed at C=8 (16 SSE events sent one write each, chunked,
relayed as blocks as the router does with ``relay=True``). The stub is a raw-asyncio HTTP/1.1
keep-alive server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
import time

import aiohttp
from yarl import URL

from zml_router.node.dispatch import NodeClient, post_json, stream_sse
from zmlcore.runtime.launch import free_port
from zmlcore.reply.sse import EventRelay

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'
HEADERS = {"content-type": "application/json", "x-zml-routing": "node=a;family=b;policy=c;queue=0;decision=d",
           "x-request-id": "r1"}
EVENTS = 16

STUB = textwrap.dedent('''
    import asyncio, sys
    REPLY = b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21}}'
    RESP = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n" % len(REPLY) + REPLY
    SSE_HEAD = b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\ntransfer-encoding: chunked\\r\\n\\r\\n"
    EV = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\\n\\n'
    def chunk(b): return b"%x\\r\\n" % len(b) + b + b"\\r\\n"
    class P(asyncio.Protocol):
        def connection_made(self, t): self.t, self.buf = t, b""
        def data_received(self, d):
            self.buf += d
            while True:
                head, sep, rest = self.buf.partition(b"\\r\\n\\r\\n")
                if not sep: return
                n = 0
                for line in head.split(b"\\r\\n"):
                    if line[:15].lower() == b"content-length:": n = int(line[15:])
                if len(rest) < n: return
                self.buf = rest[n:]
                if b"/stream" in head.split(b"\\r\\n", 1)[0]:
                    asyncio.ensure_future(self.stream())
                else:
                    self.t.write(RESP)
        async def stream(self):
            self.t.write(SSE_HEAD)
            for _ in range(EVENTS_N):
                self.t.write(chunk(EV))
                await asyncio.sleep(0)
            self.t.write(chunk(b"data: [DONE]\\n\\n") + b"0\\r\\n\\r\\n")
    async def main():
        srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]))
        await srv.serve_forever()
    asyncio.run(main())
''').replace("EVENTS_N", str(EVENTS))


class Aiohttp:
    """The router's previous node client: aiohttp called directly, as dispatch.py did."""

    def __init__(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=0, ttl_dns_cache=300),
            cookie_jar=aiohttp.DummyCookieJar(), headers={"accept-encoding": "identity"},
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=5.0, sock_read=None))
        self.urls: dict[str, URL] = {}

    def _url(self, url: str) -> URL:
        u = self.urls.get(url)
        if u is None:
            u = self.urls[url] = URL(url)
        return u

    async def call(self, url: str) -> bytes:
        resp = await self.session.request("POST", self._url(url), data=BODY, headers=HEADERS, allow_redirects=False)
        try:
            if resp.content_length is not None:
                return await resp.content.read()
            return b"".join([c async for c in resp.content.iter_any()])
        finally:
            resp.release()

    async def stream(self, url: str) -> int:
        resp = await self.session.request("POST", self._url(url), data=BODY, headers=HEADERS, allow_redirects=False)
        n = 0
        try:
            events = EventRelay()
            async for raw in resp.content.iter_any():
                if events.feed(raw):
                    n += 1
                if events.done:
                    break
        finally:
            resp.release()
        return n

    async def aclose(self) -> None:
        await self.session.close()


class Lean:
    """zml_router.node.dispatch as the router calls it (zml_router.node.client underneath)."""

    def __init__(self) -> None:
        self.client = NodeClient(256, 5.0)

    async def call(self, url: str) -> bytes:
        return await post_json(self.client, url, BODY, HEADERS)

    async def stream(self, url: str) -> int:
        n = 0
        async for _ in stream_sse(self.client, url, BODY, HEADERS, relay=True):
            n += 1
        return n

    async def aclose(self) -> None:
        await self.client.aclose()


async def cost(client: Aiohttp | Lean, url: str, calls: int, conc: int, streamed: bool) -> float:
    op = client.stream if streamed else client.call
    for _ in range(100):  # warm: connections open, caches filled
        await op(url)

    async def worker(n: int) -> None:
        for _ in range(n):
            await op(url)

    t0 = time.process_time()
    await asyncio.gather(*(worker(calls // conc) for _ in range(conc)))
    return (time.process_time() - t0) / (calls // conc * conc) * 1e6


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    results: dict[tuple[str, str], list[float]] = {}
    cases = (("non-streamed C=1", "/v1/chat/completions", 1, False),
             ("non-streamed C=32", "/v1/chat/completions", 32, False),
             (f"streamed ({EVENTS} events) C=8", "/stream", 8, True))
    try:
        await asyncio.sleep(0.5)
        base = f"http://127.0.0.1:{port}"
        for rep in range(a.reps):
            for name, make in (("aiohttp direct", Aiohttp), ("nodeclient (httptools)", Lean)):
                client = make()
                try:
                    for case, path, conc, streamed in cases:
                        calls = a.calls // 4 if streamed else a.calls
                        us = await cost(client, base + path, calls, conc, streamed)
                        results.setdefault((name, case), []).append(us)
                        print(f"rep {rep + 1}  {name:24s} {case:28s} {us:7.1f} µs CPU/call", flush=True)
                finally:
                    await client.aclose()
    finally:
        stub.terminate()
        stub.wait(10)
    print("\n| client | case | CPU µs/call (median) |\n|---|---|---|")
    for (name, case), v in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {name} | {case} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()  # as the router runs
    except ImportError:
        pass
    asyncio.run(main())
