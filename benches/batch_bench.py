#!/usr/bin/env python3
"""The Batch API's targets (issue 21), measured on the demo fleet (docs/benchmarks.md, "Batch API").

``--mode load``: the demo fleet (sdk/src/zml/data/demo.toml: 7 sims, 2 H100, A100, 2 MI300X,
Gaudi2, Inferentia2, at ``--time-scale`` x real speed) with nats-server, health, one router per
two cores, a gateway and ``--runners`` batch runners, all started here by PID. Open-loop Poisson
interactive load (streamed chat requests, 816-token prompts, 274-token mean outputs: the
reference workload) at ``--load`` x the fleet's modelled capacity through the gateway, time to
first token measured at the client. Rounds of two phases, ``--phase`` seconds each:

* A: interactive alone;
* B: the same interactive load while a ``--lines``-line batch (the same lengths) runs; the batch
  is cancelled at the end of the phase (and its lines in flight drained) before the next A.

Reported per phase and as medians over rounds: interactive TTFT p50/p99, the batch's lines
completed per second against the spare capacity (modelled capacity minus the interactive rate
served), the share of its tokens per family (from its output file), and the runner's CPU per
line against the router's CPU per request over the same phase (/proc ticks).

``--mode cpu``: a batch alone on the fleet at 20x with short outputs: the runner's CPU per
line and the router's per request over the same lines (refusals included), in one run.

``--mode submit``: a ``--lines``-line file (50,000 by default) uploaded with the `openai`
package and a batch created over it; the time until the batch is ``in_progress`` (checked and
cut into shards) and where it went (upload, create, validate).

    python benches/batch_bench.py --mode load --time-scale 4 --load 0.5 --phase 120 --rounds 2
    python benches/batch_bench.py --mode submit --lines 50000
    python benches/batch_bench.py --mode cpu --lines 3000
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "sdk" / "src"))

from zml.cli._simports import relocate  # noqa: E402
from zml.cli.up import demo_config_path  # noqa: E402
from zmlcore.config import load_config  # noqa: E402
from zmlcore.fleet.perfmodel import SimProfile  # noqa: E402
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS  # noqa: E402
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, start_nats, wait_port  # noqa: E402

MODEL = "meta-llama/llama-3-8b-instruct"
WORDS = "the quick brown fox jumps over a lazy dog near the river bank".split()
#: ~4 characters per token (zmlcore.policy.estimate): a prompt of about n tokens.


def prompt(n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(n_tokens * 0.8))))


def out_tokens(rng: random.Random) -> int:
    """Output lengths around the reference mean (274), bounded like the soak's (240-308)."""
    return rng.randint(240, 308)


def ticks(pid: int) -> float:
    """CPU seconds (user + system) of one process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Fleet:
    """The demo fleet and every service, as processes of this script."""

    def __init__(self, tmp: Path, time_scale: float, runners: int, routers: int, reserve: float | None) -> None:
        self.tmp = tmp
        text = Path(demo_config_path()).read_text().replace("[nodes.sim]\n", f"[nodes.sim]\ntime_scale = {time_scale}\n")
        text = text.replace("[health]\npoll_interval_s = 5\n", "[health]\npoll_interval_s = 1\nkv_heartbeat_s = 1\n")
        if reserve is not None:
            text = text.replace("[defaults]\n", f"[router]\nbatch_reserve = {reserve}\n\n[defaults]\n", 1)
        src = tmp / "demo.toml"
        src.write_text(text)
        self.config, self.cfg = relocate(str(src), load_config(src), None, tmp)
        self.time_scale = time_scale
        self.procs: dict[str, Proc] = {}
        port = free_port()
        self.nats = start_nats("127.0.0.1", port, str(tmp / "js"))
        self.nats_url = f"nats://127.0.0.1:{port}"
        self.gw_port = free_port()
        self.procs["sim"] = spawn("sim", service_argv("sim", self.config, self.nats_url))
        self.procs["health"] = spawn("health", service_argv("health", self.config, self.nats_url))
        for i in range(routers):
            self.procs[f"router-{i + 1}"] = spawn(f"router-{i + 1}", service_argv(
                "router", self.config, self.nats_url, "--router-id", f"router-{i + 1}"))
        for i in range(runners):
            self.procs[f"batch-{i + 1}"] = spawn(f"batch-{i + 1}", service_argv(
                "batch", self.config, self.nats_url, "--runner-id", f"batch-{i + 1}"))
        self.procs["gateway"] = spawn("gateway", service_argv("gateway", self.config, self.nats_url, "--port",
                                                              str(self.gw_port)))
        assert wait_port("127.0.0.1", self.gw_port, 60), self.procs["gateway"].tail()
        self.url = f"http://127.0.0.1:{self.gw_port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                nodes = httpx.get(self.url + "/v1/nodes", timeout=5).json()["nodes"]
                if sum(n["status"] == "up" for n in nodes) == len(self.cfg.nodes):
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "fleet not up"
            time.sleep(0.5)

    def capacity_rps(self) -> float:
        """The fleet's modelled capacity (req/s at full batch) for the reference lengths."""
        total = 0.0
        for n in self.cfg.nodes:
            total += SimProfile.for_type(n.accelerator).capacity_rps(MEAN_PROMPT_TOKENS, MEAN_OUTPUT_TOKENS)
        return total * self.time_scale

    def families(self) -> dict[str, str]:
        return {n.id: n.effective_family for n in self.cfg.nodes}

    def pids(self, prefix: str) -> list[int]:
        return [p.pid for name, p in self.procs.items() if name.startswith(prefix) and p.alive()]

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()
        self.nats.stop()


class Interactive:
    """Open-loop Poisson streamed chat requests; TTFT at the client (first SSE event)."""

    def __init__(self, url: str, rate: float, seed: int) -> None:
        self.url = url
        self.rate = rate
        self.rng = random.Random(seed)
        self.ttft: list[tuple[float, float]] = []  # (start time, ttft)
        self.family: list[str] = []  # the family that served each of ttft's requests
        self.done: list[float] = []  # completion times
        self.errors: dict[str, int] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as client:
            tasks: set[asyncio.Task[None]] = set()
            next_t = time.monotonic()
            i = 0
            while not self._stop.is_set():
                next_t += self.rng.expovariate(self.rate)
                await asyncio.sleep(max(0.0, next_t - time.monotonic()))
                i += 1
                t = asyncio.create_task(self._one(client, i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=120)

    async def _one(self, client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": out_tokens(self.rng),
                "messages": [{"role": "user", "content": prompt(int(MEAN_PROMPT_TOKENS), i)}]}
        t0 = time.monotonic()
        first = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                family = r.headers.get("x-zml-family", "?")
                if r.status_code != 200:
                    await r.aread()
                    code = r.json().get("error", {}).get("code", str(r.status_code))
                    self.errors[code] = self.errors.get(code, 0) + 1
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.monotonic() - t0
            if first is not None:
                self.ttft.append((t0, first))
                self.family.append(family)
                self.done.append(time.monotonic())
        except httpx.HTTPError as exc:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1

    def stop(self) -> None:
        self._stop.set()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def batch_file(lines: int, seed: int) -> bytes:
    rng = random.Random(seed)
    rows = []
    for i in range(lines):
        rows.append(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "max_tokens": out_tokens(rng),
                                         "messages": [{"role": "user",
                                                       "content": prompt(int(MEAN_PROMPT_TOKENS), 10_000_000 + i)}]}}))
    return "\n".join(rows).encode()


def phase_stats(inter: Interactive, t0: float, t1: float) -> dict[str, Any]:
    rows = [(v, f) for (s, v), f in zip(inter.ttft, inter.family) if t0 <= s < t1]
    vals = [v for v, _ in rows]
    served = sum(1 for d in inter.done if t0 <= d < t1)
    by_family = {}
    for fam in sorted({f for _, f in rows}):
        fv = [v for v, f in rows if f == fam]
        by_family[fam] = {"n": len(fv), "p50": round(pct(fv, 0.5), 3), "p99": round(pct(fv, 0.99), 3)}
    return {"requests": len(vals), "ttft_p50_s": round(pct(vals, 0.5), 4), "ttft_p99_s": round(pct(vals, 0.99), 4),
            "served_rps": round(served / (t1 - t0), 3), "by_family": by_family}


def cpu_of(fleet: Fleet) -> dict[str, float]:
    """CPU seconds so far of each kind of process (sim, router, gateway, batch, health)."""
    out: dict[str, float] = {}
    for name, p in fleet.procs.items():
        if p.alive():
            kind = name.split("-")[0]
            out[kind] = out.get(kind, 0.0) + ticks(p.pid)
    return out


async def load_mode(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="zml-batch-bench-"))
    cores = os.cpu_count() or 2
    fleet = Fleet(tmp, args.time_scale, args.runners, max(1, cores // 2), args.reserve)
    events = Events()
    try:
        await events.start(fleet.nats_url)
        cap = fleet.capacity_rps()
        rate = args.load * cap
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=2, timeout=120)
        print(f"capacity {cap:.2f} req/s, interactive {rate:.2f} req/s; uploading {args.lines} lines", flush=True)
        data = batch_file(args.lines, 7)
        inter = Interactive(fleet.url, rate, 1)
        load = asyncio.create_task(inter.run())
        await asyncio.sleep(args.warmup)
        rounds = []
        for r in range(args.rounds):
            a0, ca0 = time.monotonic(), cpu_of(fleet)
            await asyncio.sleep(args.phase)
            a1, ca1 = time.monotonic(), cpu_of(fleet)
            a = phase_stats(inter, a0, a1)
            a["cpu_share"] = {k: round((ca1[k] - ca0.get(k, 0.0)) / (a1 - a0), 3) for k in ca1}
            f = await asyncio.to_thread(client.files.create, file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
            b = await asyncio.to_thread(client.batches.create, input_file_id=f.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
            while (await asyncio.to_thread(client.batches.retrieve, b.id)).status == "validating":
                await asyncio.sleep(0.2)
            await asyncio.sleep(args.settle)  # the runner's window fills
            cpu0 = {pid: ticks(pid) for pid in fleet.pids("batch") + fleet.pids("router")}
            done0 = (await asyncio.to_thread(client.batches.retrieve, b.id)).request_counts
            reqs0, ref0 = events.handled, events.refused
            b0, cb0 = time.monotonic(), cpu_of(fleet)
            await asyncio.sleep(args.phase)
            b1, cb1 = time.monotonic(), cpu_of(fleet)
            done1 = (await asyncio.to_thread(client.batches.retrieve, b.id)).request_counts
            reqs1, ref1 = events.handled, events.refused
            cpu1 = {pid: ticks(pid) for pid in cpu0}
            bstats = phase_stats(inter, b0, b1)
            bstats["cpu_share"] = {k: round((cb1[k] - cb0.get(k, 0.0)) / (b1 - b0), 3) for k in cb1}
            lines = (done1.completed + done1.failed) - (done0.completed + done0.failed)
            batch_rps = lines / (b1 - b0)
            spare = cap - bstats["served_rps"]
            runner_cpu = sum(cpu1[p] - cpu0[p] for p in fleet.pids("batch"))
            router_cpu = sum(cpu1[p] - cpu0[p] for p in fleet.pids("router"))
            await asyncio.to_thread(client.batches.cancel, b.id)
            final = b
            while final.status not in ("cancelled", "completed", "expired", "failed"):
                await asyncio.sleep(0.5)
                final = await asyncio.to_thread(client.batches.retrieve, b.id)
            tokens: dict[str, int] = {}
            if final.output_file_id:
                text = (await asyncio.to_thread(client.files.content, final.output_file_id)).text
                for line in text.splitlines():
                    row = json.loads(line)
                    body = row["response"]["body"]
                    fam = body.get("zml", {}).get("family", "?")
                    tokens[fam] = tokens.get(fam, 0) + body["usage"]["total_tokens"]
            total_t = sum(tokens.values()) or 1
            handled = reqs1 - reqs0
            rounds.append({
                "A": a, "B": bstats,
                "ttft_p99_ratio": round(bstats["ttft_p99_s"] / a["ttft_p99_s"], 3),
                "batch_lines_per_s": round(batch_rps, 3), "spare_rps": round(spare, 3),
                "spare_used": round(batch_rps / spare, 3) if spare > 0 else None,
                "batch_tokens_by_family": {k: round(v / total_t, 3) for k, v in sorted(tokens.items())},
                "runner_cpu_ms_per_line": round(1000 * runner_cpu / max(1, lines), 3),
                "router_cpu_ms_per_request": round(1000 * router_cpu / max(1, handled), 3),
                "router_requests": handled, "batch_refusals": ref1 - ref0, "interactive_errors": dict(inter.errors),
            })
            print(json.dumps(rounds[-1]), flush=True)
            await asyncio.sleep(args.drain)
        inter.stop()
        await load
        return {"capacity_rps": round(cap, 3), "interactive_rps": round(rate, 3), "rounds": rounds,
                "median": {k: statistics.median(r[k] for r in rounds)
                           for k in ("ttft_p99_ratio", "spare_used", "runner_cpu_ms_per_line",
                                     "router_cpu_ms_per_request")}}
    finally:
        await events.close()
        fleet.stop()


class Events:
    """The routers' completion events: every request a router finished (answered or refused)."""

    def __init__(self) -> None:
        self.handled = 0
        self.refused = 0
        self._nc: Any = None

    async def start(self, url: str) -> None:
        import nats

        from zmlcore import subjects
        from zmlcore.messages.warmup import completed_decoder

        self._nc = await nats.connect(url)

        async def on(msg: Any) -> None:
            ev = completed_decoder.decode(msg.data)
            self.handled += 1
            self.refused += ev.error_code == "QUEUE_FULL"

        await self._nc.subscribe(subjects.event(subjects.EVENT_COMPLETED), cb=on)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


def submit_mode(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="zml-batch-submit-"))
    fleet = Fleet(tmp, 20.0, args.runners, 1, None)
    try:
        rows = "\n".join(json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": MODEL, "max_tokens": 16,
                                              "messages": [{"role": "user", "content": prompt(200, i)}]}})
                         for i in range(args.lines)).encode()
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
        t0 = time.monotonic()
        f = client.files.create(file=("big.jsonl", io.BytesIO(rows)), purpose="batch")
        t1 = time.monotonic()
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t2 = time.monotonic()
        while (b := client.batches.retrieve(b.id)).status == "validating":
            time.sleep(0.05)
        t3 = time.monotonic()
        try:
            client.batches.cancel(b.id)
        except openai.ConflictError:  # it already ran to the end
            pass
        return {"lines": args.lines, "bytes": len(rows), "upload_s": round(t1 - t0, 2), "create_s": round(t2 - t1, 3),
                "validate_s": round(t3 - t2, 2), "submit_and_validate_s": round(t3 - t0, 2), "status": b.status}
    finally:
        fleet.stop()


async def cpu_mode(args: argparse.Namespace) -> dict[str, Any]:
    """A batch alone on a fast fleet (the sims at 20x, short outputs): CPU per line of the
    runner and per request of the router over the same lines (refusals included)."""
    tmp = Path(tempfile.mkdtemp(prefix="zml-batch-cpu-"))
    fleet = Fleet(tmp, 20.0, 1, 1, args.reserve)
    events = Events()
    try:
        await events.start(fleet.nats_url)
        rows = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": MODEL, "max_tokens": 32,
                                              "messages": [{"role": "user", "content": prompt(200, i)}]}})
                         for i in range(args.lines)).encode()
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
        f = client.files.create(file=("cpu.jsonl", io.BytesIO(rows)), purpose="batch")
        pids = {"runner": fleet.pids("batch"), "router": fleet.pids("router"), "gateway": fleet.pids("gateway"),
                "sim": fleet.pids("sim")}
        cpu0 = {k: sum(ticks(p) for p in v) for k, v in pids.items()}
        h0, r0 = events.handled, events.refused
        t0 = time.monotonic()
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(0.5)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.0)  # the last completion events
        cpu1 = {k: sum(ticks(p) for p in v) for k, v in pids.items()}
        handled, refused = events.handled - h0, events.refused - r0
        used = {k: cpu1[k] - cpu0[k] for k in cpu0}
        return {"lines": args.lines, "status": b.status, "seconds": round(elapsed, 1),
                "lines_per_s": round(args.lines / elapsed, 1), "router_requests": handled, "refusals": refused,
                "runner_cpu_ms_per_line": round(1000 * used["runner"] / args.lines, 3),
                "router_cpu_ms_per_request": round(1000 * used["router"] / max(1, handled), 3),
                "router_cpu_ms_per_line": round(1000 * used["router"] / args.lines, 3),
                "cpu_s": {k: round(v, 2) for k, v in used.items()}}
    finally:
        await events.close()
        fleet.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("load", "submit", "cpu"), default="load")
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--load", type=float, default=0.5, help="interactive rate as a share of modelled capacity")
    p.add_argument("--lines", type=int, default=None, help="batch lines (load: 20,000; submit: 50,000)")
    p.add_argument("--phase", type=float, default=120.0, help="seconds of each phase")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--settle", type=float, default=10.0, help="seconds after a batch starts before measuring")
    p.add_argument("--drain", type=float, default=15.0, help="seconds after a cancel before the next phase")
    p.add_argument("--runners", type=int, default=1)
    p.add_argument("--reserve", type=float, default=None, help="[router] batch_reserve (default: zml.toml's)")
    p.add_argument("--save", help="write the JSON result here")
    args = p.parse_args()
    started = time.time()
    load1 = os.getloadavg()[0]
    if args.mode == "submit":
        args.lines = args.lines or 50_000
        out = submit_mode(args)
    elif args.mode == "cpu":
        args.lines = args.lines or 3000
        out = asyncio.run(cpu_mode(args))
    else:
        args.lines = args.lines or 20_000

        out = asyncio.run(load_mode(args))
    out["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
                      "load_before": round(load1, 2), "load_after": round(os.getloadavg()[0], 2),
                      "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
                      "minutes": round((time.time() - started) / 60, 1)}
    out["args"] = vars(args)
    print(json.dumps(out, indent=1))
    if args.save:
        Path(args.save).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
