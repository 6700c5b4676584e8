#!/usr/bin/env python3
"""Closed-loop gRPC load on the gateway's zml.v1.Zml (Infer or InferStream), the twin of the
peers harness's load.py: C workers with one call in flight each, N calls after a warm-up, a
hard wall-clock bound, one JSON line with req/s and latency percentiles (ms).

    python benches/grpc_load.py --target 127.0.0.1:50051 -c 64 -n 20000 --max-seconds 10

One grpc.aio channel (HTTP/2 multiplexes the C calls on it), the same request as load.py
(one user message, max_tokens 16, model stub-model). Used by benches/peers_path.py --grpc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from zmlcore.rpc import zml_pb2 as pb
from zmlcore.rpc import zml_pb2_grpc


def pct(sorted_vals: list[float], p: float) -> float | None:
    if not sorted_vals:
        return None
    k = max(0, min(len(sorted_vals) - 1, int(round(p / 100.0 * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[k]


async def run(a: argparse.Namespace) -> dict[str, object]:
    req = pb.InferRequest(model=a.model, messages=[pb.ChatMessage(role="user", content=a.prompt)],
                          max_tokens=a.max_tokens)
    md = (("authorization", "Bearer " + a.api_key),)
    lat: list[float] = []
    errors = 0
    samples: list[str] = []
    async with grpc.aio.insecure_channel(a.target) as channel:
        stub = zml_pb2_grpc.ZmlStub(channel)

        async def one() -> float:
            t0 = time.perf_counter()
            if a.stream:
                got = [c async for c in stub.InferStream(req, metadata=md, timeout=a.request_timeout)]
                if not got:
                    raise RuntimeError("empty stream")
            else:
                reply = await stub.Infer(req, metadata=md, timeout=a.request_timeout)
                if not reply.choices:
                    raise RuntimeError("no choices")
            return time.perf_counter() - t0

        async def warm(k: int) -> None:
            for _ in range(k):
                try:
                    await one()
                except Exception:  # noqa: BLE001
                    pass

        if a.warmup > 0:
            await asyncio.gather(*[warm(max(1, a.warmup // a.concurrency)) for _ in range(a.concurrency)])
        remaining = [a.requests]
        deadline = time.perf_counter() + a.max_seconds

        async def worker() -> None:
            nonlocal errors
            while remaining[0] > 0 and time.perf_counter() < deadline:
                remaining[0] -= 1
                try:
                    lat.append(await one())
                except Exception as exc:  # noqa: BLE001
                    errors += 1
                    if len(samples) < 3:
                        samples.append(repr(exc)[:200])

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(a.concurrency)]),
                               timeout=a.max_seconds + a.request_timeout + 5)
        elapsed = time.perf_counter() - t0
    lat.sort()

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000.0, 3)

    res: dict[str, object] = {
        "label": a.label, "tool": "grpc_load.py/grpcio-" + grpc.__version__, "url": "grpc://" + a.target,
        "concurrency": a.concurrency, "stream": bool(a.stream), "requested": a.requests, "ok": len(lat),
        "errors": errors, "elapsed_s": round(elapsed, 3), "rps": round(len(lat) / elapsed, 1) if elapsed > 0 else 0,
        "p50_ms": ms(pct(lat, 50)), "p95_ms": ms(pct(lat, 95)), "p99_ms": ms(pct(lat, 99)),
        "mean_ms": ms(sum(lat) / len(lat)) if lat else None, "max_ms": ms(lat[-1] if lat else None),
    }
    if samples:
        res["error_samples"] = samples
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--requests", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=30.0)
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--prompt", default="Say hello in one short sentence.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--api-key", default="sk-bench")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    res = asyncio.run(run(a))
    print(json.dumps(res), flush=True)
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()
