#!/usr/bin/env python3
"""What a non-streamed request costs the router when it is asked of the node as a stream and the
reply put together (issue 20 item 4, ``[models.X] stream_from_nodes``), split in two: the HTTP
side (``dispatch.post`` of the JSON reply vs ``dispatch.post_streamed`` of the SSE body) and the
assembly (``zml_router.answer.assemble.Assembler``). The peers harness's stub_backend.py is the node (16
tokens); this process is the router's node client, 16 requests at a time; CPU from
``time.process_time`` (this process only: the stub's own work is not in it). Medians of --reps.

    python benches/assemble_cost.py --harness ../shared/peers --reps 5

benches/router_cost.py measures the whole router process (NATS included) for the same switch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from zml_router.answer.assemble import Assembler, as_stream
from zml_router.node.dispatch import NodeClient, post, post_streamed
from zml_router.timers import Wheel
from zmlcore.runtime.launch import free_port, wait_port

BODY = json.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "Say hi in five words."}],
                   "max_tokens": 16}).encode()
HEADERS = {"content-type": "application/json"}


async def measure(url: str, reps: int, n: int) -> dict[str, list[float]]:
    client, wheel = NodeClient(64, 5.0), Wheel()

    def first(complete: bool) -> None:
        pass

    async def whole() -> None:
        with wheel.deadline(10):
            await post(client, url, BODY, HEADERS)

    async def streamed(assemble: bool = False) -> None:
        got: list[bytes] = []
        await post_streamed(client, url, as_stream(BODY), HEADERS, timers=wheel, first_byte=10, stall_s=10,
                            max_bytes=1 << 24, first=first, feed=got.append)
        if assemble:
            asm = Assembler("chat")
            asm.feed(b"".join(got))
            assert asm.done
            asm.reply()

    async def assembled() -> None:
        await streamed(True)

    out: dict[str, list[float]] = {}
    try:
        for _ in range(reps):  # interleaved: the same neighbours for each
            for name, call in (("JSON reply (post)", whole), ("SSE body (post_streamed)", streamed),
                               ("SSE body + assembly", assembled)):
                for _ in range(200):
                    await call()

                async def worker(call=call) -> None:  # type: ignore[no-untyped-def]
                    for _ in range(n // 16):
                        await call()

                t = time.process_time()
                await asyncio.gather(*(worker() for _ in range(16)))
                out.setdefault(name, []).append((time.process_time() - t) / n * 1e6)
    finally:
        await client.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=3200, help="requests per variant and rep")
    a = ap.parse_args()
    stub = os.path.join(a.harness, "stub_backend.py")
    if not os.path.exists(stub):
        sys.exit(f"no {stub}: pass --harness")
    port = free_port()
    proc = subprocess.Popen([sys.executable, stub, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        if not wait_port("127.0.0.1", port, 15):
            sys.exit("the stub did not start")
        res = asyncio.run(measure(f"http://127.0.0.1:{port}/v1/chat/completions", a.reps, a.n))
    finally:
        proc.terminate()
        proc.wait(10)
    print("| variant | router-side CPU us/request (median) | reps |\n|---|---|---|")
    for name, xs in res.items():
        print(f"| {name} | {statistics.median(xs):.1f} | {len(xs)} |")


if __name__ == "__main__":
    main()
