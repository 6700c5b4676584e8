"""`zml bench`: the client-side concurrency sweep of the batch-client guide.

For each concurrency level ``c`` it sends ``--requests`` requests with at most ``c`` in
flight and prints throughput and latency percentiles::

    c=1    rps=3.14  p50=0.401s  p95=0.412s  p99=0.420s  svc_p95=0.410s  q_p95=0.001s  err=0/50  elapsed=15.9s

Each level runs ``c`` closed-loop workers. ``svc`` is the time of the request itself; ``q``
the time a request waited inside the client before it went out (rate limiter, retries'
backoff). High ``q_p95`` next to ``svc_p95`` means the client is the bottleneck. It ends with ``recommended_max_parallel_requests=N``: the smallest level whose
throughput is within 10 % of the best error-free level.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from zml._async_client import AsyncClient
from zml._errors import BadRequestError, ZMLError
from zml.cli._common import add_client_args, add_request_args, client_kwargs, request_kwargs


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="client-side concurrency sweep", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_request_args(p, max_tokens=64)
    p.add_argument("--requests", "-n", type=int, default=50, help="requests per level (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="requests before the sweep (default 5)")
    lim = p.add_argument_group("client-side rate limits (to see their effect on q_p95)")
    lim.add_argument("--rpm", type=float, help="requests per minute")
    lim.add_argument("--tpm", type=float, help="tokens per minute")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="levels, comma-separated (default 1,2,4,8,16,32)")
    p.add_argument("--prompt", default="Write a haiku.", help="prompt (default 'Write a haiku.')")
    p.add_argument("--input-jsonl", help="prompts to cycle through (as `zml batch --input`)")
    p.add_argument("--output-json", help="write the levels and the recommendation here")
    add_client_args(p, retries=0)
    p.set_defaults(func=run)


@dataclass
class Level:
    c: int
    requests: int
    errors: int
    elapsed_s: float
    rps: float
    p50_s: float
    p95_s: float
    p99_s: float
    svc_p95_s: float
    q_p95_s: float

    def line(self) -> str:
        return (f"c={self.c:<5}rps={self.rps:.2f}  p50={self.p50_s:.3f}s  p95={self.p95_s:.3f}s  "
                f"p99={self.p99_s:.3f}s  svc_p95={self.svc_p95_s:.3f}s  q_p95={self.q_p95_s:.3f}s  "
                f"err={self.errors}/{self.requests}  elapsed={self.elapsed_s:.1f}s")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def recommend(levels: Sequence[Level], within: float = 0.10) -> int:
    """Smallest level within ``within`` of the best throughput, preferring error-free levels."""
    clean = [lv for lv in levels if lv.errors == 0] or list(levels)
    if not clean:
        return 1
    best = max(lv.rps for lv in clean)
    return min(lv.c for lv in clean if lv.rps >= (1.0 - within) * best)


async def run_level(client: AsyncClient, c: int, n: int, items: Sequence[dict[str, Any]]) -> Level:
    """``n`` requests from ``c`` closed-loop workers (each sends its next request when the
    previous one is done), as a client with ``max_parallel_requests=c`` runs a batch."""
    lat: list[float] = []
    svc: list[float] = []
    queue: list[float] = []
    errors = 0
    cycle = itertools.cycle(items)
    todo = iter([next(cycle) for _ in range(n)])

    async def worker() -> None:
        nonlocal errors
        for item in todo:
            started = time.perf_counter()
            try:
                result = await client.infer(**item)
            except ZMLError:
                errors += 1
                lat.append(time.perf_counter() - started)
                continue
            elapsed = time.perf_counter() - started
            waited = max(0.0, result.metrics.latency_s - result.metrics.service_s)  # client-side wait
            lat.append(elapsed)
            svc.append(max(0.0, elapsed - waited))
            queue.append(waited)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(c, n))))
    elapsed = time.perf_counter() - t0
    return Level(c=c, requests=n, errors=errors, elapsed_s=elapsed, rps=(n - errors) / elapsed if elapsed else 0.0,
                 p50_s=percentile(lat, 50), p95_s=percentile(lat, 95), p99_s=percentile(lat, 99),
                 svc_p95_s=percentile(svc, 95), q_p95_s=percentile(queue, 95))


def _levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError as exc:
        raise BadRequestError(f"--concurrency: expected integers like 1,2,4: {spec!r}") from exc
    if not levels or any(c < 1 for c in levels):
        raise BadRequestError("--concurrency: levels must be >= 1")
    return levels


async def sweep(args: argparse.Namespace) -> dict[str, Any]:
    levels = _levels(args.concurrency)
    common = request_kwargs(args)
    if args.input_jsonl:
        from zml.cli._batchio import read_items

        items = [{**common, **item} for item in read_items(args.input_jsonl, chat=True)]
    else:
        items = [{**common, "messages": [{"role": "user", "content": args.prompt}]}]
    for item in items:
        item.setdefault("model", args.model)
    results: list[Level] = []
    limits = {k: v for k, v in (("rpm", args.rpm), ("tpm", args.tpm)) if v is not None}
    async with AsyncClient(**client_kwargs(args), max_connections=max(levels), **limits) as client:
        if args.warmup > 0:
            await run_level(client, min(max(levels), args.warmup), args.warmup, items)
        for c in levels:
            level = await run_level(client, c, args.requests, items)
            results.append(level)
            print(level.line(), flush=True)
    rec = recommend(results)
    print(f"recommended_max_parallel_requests={rec}", flush=True)
    return {"model": args.model, "requests": args.requests, "warmup": args.warmup,
            "levels": [asdict(lv) for lv in results], "recommended_max_parallel_requests": rec}


def run(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise BadRequestError("--requests must be >= 1")
    report = asyncio.run(sweep(args))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    if all(lv["errors"] == lv["requests"] for lv in report["levels"]):
        print("zml bench: every request failed; check the model name and `zml nodes`", file=sys.stderr)
        return 1
    return 0
