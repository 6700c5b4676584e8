"""CPU per call of the router's node client (zml_router.dispatch) against httpx's API over the
same aiohttp transport (what the router used before), on one loop, against a stub node in
another process (so its CPU is not counted).

    python benches/node_client_cost.py [--calls 4000] [--reps 3]

Prints CPU µs per call (this process only) at C=1 and C=32 for each client, per rep, and the
median. The stub is a raw-asyncio HTTP/1.1 keep-alive server answering a fixed ~400-byte JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import textwrap
import time

from zml_router.dispatch import NodeClient, post_json
from zmlcore.launch import free_port

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'
HEADERS = {"content-type": "application/json", "x-zml-routing": "node=a;family=b;policy=c;queue=0;decision=d",
           "x-request-id": "r1"}

STUB = textwrap.dedent('''
    import asyncio, sys
    REPLY = b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok tok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":16,"total_tokens":21}}'
    RESP = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n" % len(REPLY) + REPLY
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
                self.t.write(RESP)
    async def main():
        srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]))
        await srv.serve_forever()
    asyncio.run(main())
''')


class HttpxOverAiohttp:
    """The previous client: httpx Requests/Responses sent straight to the aiohttp transport."""

    def __init__(self) -> None:
        import aiohttp
        import httpx
        from httpx_aiohttp import AiohttpTransport

        self.httpx = httpx
        self.transport = AiohttpTransport(client=aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, limit_per_host=0), cookie_jar=aiohttp.DummyCookieJar()))
        self.timeout = {"connect": 5.0, "read": None, "write": None, "pool": None}
        self.urls: dict[str, object] = {}

    async def call(self, url: str) -> bytes:
        u = self.urls.get(url) or self.urls.setdefault(url, self.httpx.URL(url))
        req = self.httpx.Request("POST", u, content=BODY, headers=HEADERS, extensions={"timeout": self.timeout})
        resp = await self.transport.handle_async_request(req)
        try:
            return b"".join([c async for c in resp.aiter_bytes()])
        finally:
            await resp.aclose()

    async def aclose(self) -> None:
        await self.transport.aclose()


class Direct:
    def __init__(self) -> None:
        self.client = NodeClient(256, 5.0)

    async def call(self, url: str) -> bytes:
        return await post_json(self.client, url, BODY, HEADERS)

    async def aclose(self) -> None:
        await self.client.aclose()


async def cost(client: HttpxOverAiohttp | Direct, url: str, calls: int, conc: int) -> float:
    for _ in range(200):  # warm: connections open, caches filled
        await client.call(url)

    async def worker(n: int) -> None:
        for _ in range(n):
            await client.call(url)

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
    results: dict[tuple[str, int], list[float]] = {}
    try:
        await asyncio.sleep(0.5)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        for rep in range(a.reps):
            for name, make in (("httpx over aiohttp", HttpxOverAiohttp), ("aiohttp direct (NodeClient)", Direct)):
                client = make()
                try:
                    for conc in (1, 32):
                        us = await cost(client, url, a.calls, conc)
                        results.setdefault((name, conc), []).append(us)
                        print(f"rep {rep + 1}  {name:28s} C={conc:<3d} {us:7.1f} µs CPU/call", flush=True)
                finally:
                    await client.aclose()
    finally:
        stub.terminate()
        stub.wait(10)
    print("\n| client | C | CPU µs/call (median) |\n|---|---|---|")
    for (name, conc), v in results.items():
        print(f"| {name} | {conc} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()  # as the router runs
    except ImportError:
        pass
    asyncio.run(main())
