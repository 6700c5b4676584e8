#!/usr/bin/env python3
"""A llama-server's prefill time against prompt length: why a calibration's prompt length matters
(docs/benchmarks.md "Real mixed fleet, session of 2026-12-08").

Starts the real-fleet bench's two llama-servers (tests/engine/llamaserver.py ``FAST`` 64x2 and
``SLOW`` 128x4, one thread, free 127.0.0.1 ports), sends each, one request at a time and
interleaved, prompts of several lengths that no cache holds (``cache_prompt: false``), and prints
llama.cpp's own prompt time per token (the fastest of ``--reps`` and the median): on attention-bound
models it grows with the context each token attends to, so a speed measured on a short prompt
overstates it on a long one.

    .venv/bin/python benches/prefill_by_length.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
import llamaserver  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--words", default="40,100,200,400,600", help="prompt lengths in words (~2.9 tokens each)")
    a = ap.parse_args()
    reason = llamaserver.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    lengths = [int(w) for w in a.words.split(",")]
    servers = llamaserver.unequal_fleet({"fast": llamaserver.FAST, "slow": llamaserver.SLOW}, measure=False)
    got: dict[tuple[str, int], list[tuple[int, float]]] = {}
    try:
        with httpx.Client(timeout=120) as c:
            for s in servers:  # untimed: a fresh engine's first request pages its weights in
                c.post(s.url + "/completion", json={"prompt": "hi", "n_predict": 2})
            for _ in range(a.reps):
                for words in lengths:
                    for s in servers:
                        text = uuid.uuid4().hex + " " + " ".join(f"w{i % 97}" for i in range(words))
                        t = c.post(s.url + "/completion", json={"prompt": text, "n_predict": 4, "cache_prompt": False,
                                                                "temperature": 0.0}).json()["timings"]
                        got.setdefault((s.node_id, words), []).append((int(t["prompt_n"]), float(t["prompt_ms"])))
    finally:
        llamaserver.stop_fleet(servers)
    print("| node | prompt tokens | us per token (fastest) | us per token (median) | tokens/s (fastest) |")
    print("|---|---|---|---|---|")
    for (node, _words), runs in sorted(got.items()):
        n = runs[0][0]
        ms = sorted(m for _, m in runs)
        print(f"| {node} | {n:,} | {ms[0] / n * 1000:.0f} | {statistics.median(ms) / n * 1000:.0f} | {n / ms[0] * 1000:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
