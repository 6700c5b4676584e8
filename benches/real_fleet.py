#!/usr/bin/env python3
"""ZML against the routers a user would pick instead, on real llama-servers of unequal speed
(issue 28 item 6): one run, the same engines, the same multi-turn workload, every router from a
cold start.

Fleet: two llama-servers (the tests' generated llamas, tests/engine/llamaserver.py: ``FAST`` 64x2
and ``SLOW`` 128x4, ~3.5x apart at prompt processing on one thread), ``--parallel 4``, one model
name (``tiny-llama``), on free 127.0.0.1 ports. Their speeds are measured from llama.cpp's own
``timings`` before every run and printed.

Routers (each started fresh for its run, the engines restarted too so that no KV cache carries
over from the previous router):

* ``zml``: ``zml up --config`` with both as ``accelerator = "cpu"``, ``backend = "llamacpp"``
  nodes, ``[defaults] policy = "latency"`` (its own NATS, a fresh data dir, one router, one gateway);
* ``vllm-ca``: vLLM's router (PyPI ``vllm-router``), ``--policy cache_aware``;
* ``sglang-ca``: SGLang's model gateway (PyPI ``sglang-router``, ``smg launch``), ``--policy cache_aware``;
* ``vllm-rr``: vLLM's router, ``--policy round_robin``.

The Rust routers come from ``--rust-venv`` (default: ``~/.cache/zml/peers/venv-rust`` if it
exists, else ``.venv-rust`` in the repository), made with
``python3 -m venv .venv-rust && .venv-rust/bin/pip install vllm-router==0.1.17 sglang-router==0.3.2``
(the versions ../shared/peers/setup.sh pins).

Per run: the same warm-up (8 requests, one at a time, short prompts of their own, then 6 s),
then the workload: 12 conversations at once, 5 turns each, each opening with one of 3 long
system prompts (~1,100 tokens, shared by 4 conversations each), streamed, no session hints, the
next turn sent as soon as the answer ends (its text appended to the conversation). The
same seeded workload for every router; routers alternate within a round (``--rounds``).

Measured: TTFT p50 (client: request sent to first content chunk), follow-up TTFT p90 (turns
2-5), the share of uncached prompt tokens processed on the slow node (the engines' own
``llamacpp:prompt_tokens_total``, which counts only tokens not served from the prompt cache;
warm-up excluded), wall time of the workload, errors; in the JSON also each engine's generated
tokens (``llamacpp:tokens_predicted_total``: how the work was split, for every router) and, for
ZML, the node each reply names and its estimates after the run. A markdown table on stdout, JSON with
``--save``.

    .venv/bin/python benches/real_fleet.py --rounds 2 --save $SCRATCH/real_fleet.json

Needs what the real-engine tests need (``bash .ci/llama-server``). Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
import llamaserver  # noqa: E402

from zmlcore.runtime.launch import Proc, free_port, spawn  # noqa: E402

MODEL = "tiny-llama"  # the engines' --alias, and ZML's model name: every router sends the same body
ROUTERS = ("zml", "vllm-ca", "sglang-ca", "vllm-rr")
NODES = {"llama-fast": llamaserver.FAST, "llama-slow": llamaserver.SLOW}
SLOW = "llama-slow"


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def default_rust_venv() -> str:
    cached = Path.home() / ".cache" / "zml" / "peers" / "venv-rust"
    return str(cached if (cached / "bin" / "vllm-router").exists() else ROOT / ".venv-rust")


# --- the workload ----------------------------------------------------------------------------

def words(rng: random.Random, n: int) -> str:
    vocab = ("route", "token", "cache", "node", "prompt", "engine", "latency", "batch", "queue", "model",
             "answer", "request", "slot", "prefix", "speed", "fleet", "user", "system", "policy", "stream")
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(n))


def workload(seed: int, conversations: int, turns: int, systems: int, system_words: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [f"You are assistant {i} of the app. " + words(rng, system_words) for i in range(systems)]
    convs = [{"system": prompts[c % systems],
              "users": [f"User {c} asks, turn {t}: " + words(rng, 12) for t in range(turns)]}
             for c in range(conversations)]
    warmup = ["Warm-up question " + str(i) + ": " + words(rng, 60) for i in range(8)]
    return {"convs": convs, "warmup": warmup}


async def stream_chat(sess: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                      max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    rec: dict[str, Any] = {"ok": False, "text": "", "chunks": 0}
    t0 = time.monotonic()
    try:
        async with sess.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"{resp.status} {(await resp.text())[:200]}"
                return rec
            rec["node"] = resp.headers.get("x-zml-node-id")
            zml_headers = {k[6:]: v for k, v in resp.headers.items() if k.lower().startswith("x-zml-")}
            if zml_headers:
                rec["zml_headers"] = zml_headers
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("timings"):  # llama-server's own figures for this request (any router passes them)
                    rec["timings"] = chunk["timings"]
                if chunk.get("zml"):  # ZML's routing metadata: node, prediction, cached tokens
                    rec["zml"] = {**rec.get("zml", {}), **chunk["zml"]}
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content")
                    if piece:
                        rec.setdefault("ttft", time.monotonic() - t0)
                        rec["text"] += piece
                        rec["chunks"] += 1
            rec["ok"] = "ttft" in rec
            if not rec["ok"]:
                rec["error"] = "no content"
    except Exception as exc:  # the bench reports errors, it does not stop on them
        rec["error"] = repr(exc)
    rec["total"] = time.monotonic() - t0
    return rec


async def run_workload(url: str, wl: dict[str, Any], max_tokens: int) -> tuple[list[dict[str, Any]], float]:
    recs: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as sess:
        async def conversation(c: int, conv: dict[str, Any]) -> None:
            messages = [{"role": "system", "content": conv["system"]}]
            for t, user in enumerate(conv["users"]):
                messages.append({"role": "user", "content": user})
                rec = await stream_chat(sess, url, messages, max_tokens)
                rec.update(conv=c, turn=t)
                recs.append(rec)
                messages.append({"role": "assistant", "content": rec["text"] or "ok"})

        t0 = time.monotonic()
        await asyncio.gather(*(conversation(c, conv) for c, conv in enumerate(wl["convs"])))
        return recs, time.monotonic() - t0


async def warm_up(url: str, prompts: list[str]) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as sess:
        return [await stream_chat(sess, url, [{"role": "user", "content": p}], 16) for p in prompts]


# --- engines and routers ---------------------------------------------------------------------

def engine_counts(url: str) -> tuple[float, float]:
    """llama.cpp's counts of prompt tokens it processed (tokens served from its prompt cache are
    not counted) and of tokens it generated."""
    text = httpx.get(url + "/metrics", timeout=5).text

    def one(name: str) -> float:
        m = re.search(rf"^llamacpp:{name}\s+(\S+)", text, re.M)
        return float(m[1]) if m else 0.0

    return one("prompt_tokens_total"), one("tokens_predicted_total")


def zml_toml(servers: list[llamaserver.Server]) -> str:
    out = ['[defaults]\npolicy = "latency"\nrequest_timeout_s = 120\n']
    for s in servers:
        out.append(f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "cpu"\nbackend = "llamacpp"\n'
                   f'endpoint = "{s.url}"\nmodels = ["{MODEL}"]\n')
    return "\n".join(out)


def zml_nodes(url: str) -> dict[str, Any]:
    """ZML's estimates of each node (``/v1/nodes``)."""
    return {n["node_id"]: {k: n.get(k) for k in ("prefill_tps", "decode_tps", "speeds_source", "speeds_confidence",
                                                 "prefill_sigma", "decode_sigma", "decode_slowdown", "model_speeds")}
            for n in httpx.get(url + "/v1/nodes", timeout=5).json()["nodes"]}


def start_router(name: str, servers: list[llamaserver.Server], tmp: Path, rust_bin: Path) -> tuple[Proc, str]:
    port = free_port()
    workers = [s.url for s in servers]
    if name == "zml":
        cfg = tmp / "zml.toml"
        cfg.write_text(zml_toml(servers))
        argv = [str(Path(sys.executable).with_name("zml")), "up", "--config", str(cfg), "--gateway-port", str(port),
                "--nats-port", str(free_port()), "--insecure", "--standby", "0", "--routers", "1",
                "--gateways", "1", "--data-dir", str(tmp / "data"), "--metrics-port", "0"]
    elif name in ("vllm-ca", "vllm-rr"):
        argv = [str(rust_bin / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                "--policy", "cache_aware" if name == "vllm-ca" else "round_robin", "--log-level", "error",
                # its metrics on a free port of their own: the default 29000 is taken by any other
                # vllm-router on the box, and the router then panics at start
                "--prometheus-port", str(free_port())]
    elif name == "sglang-ca":
        argv = [str(rust_bin / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                *workers, "--policy", "cache_aware", "--log-level", "error", "--prometheus-port", str(free_port())]
    else:
        raise ValueError(name)
    return spawn(name, argv, new_session=True), f"http://127.0.0.1:{port}"


def wait_router(name: str, proc: Proc, url: str, timeout: float = 90.0) -> None:
    """Until the router answers a model listing; ZML: until `zml up` says ready (after its own
    one-token probe request) and sees both nodes up. The bench sends no request before the
    warm-up."""
    deadline = time.monotonic() + timeout
    last = ""
    if name == "zml" and not proc.wait_for("zml ready:", timeout):
        raise RuntimeError(f"zml up not ready in {timeout:g} s:\n{proc.tail(40)}")
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{name} exited:\n{proc.tail(40)}")
        try:
            if name == "zml":
                nodes = httpx.get(url + "/v1/nodes", timeout=2).json()["nodes"]
                if len(nodes) == len(NODES) and all(n["status"] == "up" for n in nodes):
                    return
                last = str([(n["node_id"], n["status"]) for n in nodes])
            else:
                r = httpx.get(url + "/v1/models", timeout=2)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{name} not ready in {timeout:g} s: {last}\n{proc.tail(40)}")


def stop(proc: Proc) -> None:
    """SIGTERM to the router by its PID (``zml up`` stops its children); what is left of its own
    process group after 20 s is killed."""
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.popen.pid, signal.SIGKILL)  # its group: spawned with a session of its own
    except ProcessLookupError:
        pass
    proc.popen.wait(5)


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 3) if xs else None


def one_run(name: str, wl: dict[str, Any], a: argparse.Namespace, rust_bin: Path) -> dict[str, Any]:
    servers = llamaserver.unequal_fleet(NODES, alias=MODEL, log=log)
    speeds = {s.node_id: s.speeds for s in servers}
    tmp = tempfile.TemporaryDirectory(prefix=f"zml-real-fleet-{name}-")
    proc = None
    try:
        proc, url = start_router(name, servers, Path(tmp.name), rust_bin)
        wait_router(name, proc, url)
        warm = asyncio.run(warm_up(url, wl["warmup"]))
        time.sleep(a.settle)
        before = {s.node_id: engine_counts(s.url) for s in servers}
        nodes_before = zml_nodes(url) if name == "zml" else None  # what the workload is routed on at first
        load = os.getloadavg()[0]
        recs, wall = asyncio.run(run_workload(url, wl, a.max_tokens))
        after = {s.node_id: engine_counts(s.url) for s in servers}
        nodes_view = zml_nodes(url) if name == "zml" else None
    finally:
        if proc is not None:
            stop(proc)
        llamaserver.stop_fleet(servers)
        tmp.cleanup()
    ok = [r for r in recs if r["ok"]]
    prefill = {n: after[n][0] - before[n][0] for n in after}
    generated = {n: int(after[n][1] - before[n][1]) for n in after}
    total = sum(prefill.values())
    served: dict[str, int] = {}
    for r in ok:
        if r.get("node"):
            served[r["node"]] = served.get(r["node"], 0) + 1
    return {
        "router": name, "requests": len(recs), "ok": len(ok),
        "errors": [r.get("error") for r in recs if not r["ok"]][:5],
        "warmup_errors": [r.get("error") for r in warm if not r["ok"]][:3],
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
        "followup_ttft_p90_s": pct([r["ttft"] for r in ok if r["turn"] > 0], 90),
        "first_turn_ttft_p50_s": pct([r["ttft"] for r in ok if r["turn"] == 0], 50),
        "slow_uncached_prefill_share": round(prefill[SLOW] / total, 3) if total else None,
        "uncached_prompt_tokens": {n: int(v) for n, v in prefill.items()}, "generated_tokens": generated,
        "wall_s": round(wall, 2), "loadavg_1m": round(load, 2),
        "engine_speeds": {n: {"prompt_tps": round(s.prompt_tps), "decode_tps": round(s.decode_tps)}
                          for n, s in speeds.items() if s is not None},
        "served_by": served or None, "zml_nodes_before": nodes_before, "zml_nodes_after": nodes_view,
        # per request: what the engine timed (llama.cpp's timings) and, for ZML, what it decided
        "requests_detail": [{k: r.get(k) for k in ("conv", "turn", "ttft", "total", "node", "timings", "zml",
                                                   "zml_headers") if r.get(k) is not None} for r in recs],
    }


LABELS = {"zml": "**ZML, `latency`**", "vllm-ca": "vLLM's router, `cache_aware` (PyPI `vllm-router`)",
          "sglang-ca": "SGLang's gateway, `cache_aware` (PyPI `sglang-router`)",
          "vllm-rr": "vLLM's router, round-robin"}


def table(runs: list[dict[str, Any]], routers: list[str]) -> str:
    def cell(name: str, key: str, fmt: str) -> str:
        vals = [r[key] for r in runs if r["router"] == name]
        return " / ".join("—" if v is None else format(v, fmt) for v in vals)

    out = ["| router | TTFT p50 (s) | follow-up TTFT p90 (s) | uncached prefill on the slow node | wall time (s) | errors |",
           "|---|---|---|---|---|---|"]
    for name in routers:
        share = " / ".join("—" if r["slow_uncached_prefill_share"] is None else f"{r['slow_uncached_prefill_share']:.0%}"
                           for r in runs if r["router"] == name)
        errs = " / ".join(str(r["requests"] - r["ok"]) for r in runs if r["router"] == name)
        out.append(f"| {LABELS[name]} | {cell(name, 'ttft_p50_s', '.3f')} | {cell(name, 'followup_ttft_p90_s', '.3f')} "
                   f"| {share} | {cell(name, 'wall_s', '.1f')} | {errs} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {', '.join(ROUTERS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--systems", type=int, default=3, help="long system prompts shared between conversations")
    ap.add_argument("--system-words", type=int, default=400, help="~2.7 tokens per word")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    ap.add_argument("--settle", type=float, default=6.0, help="seconds between the warm-up and the workload")
    ap.add_argument("--seed", type=int, default=28)
    ap.add_argument("--rust-venv", default=default_rust_venv())
    ap.add_argument("--save", help="write the results as JSON here")
    a = ap.parse_args()
    routers = a.routers.split(",")
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        ap.error(f"unknown routers: {sorted(unknown)}")
    reason = llamaserver.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    rust_bin = Path(a.rust_venv) / "bin"
    if any(r != "zml" for r in routers) and not (rust_bin / "vllm-router").exists():
        print(f"no vllm-router in {rust_bin}: see --help for the venv", file=sys.stderr)
        return 1
    wl = workload(a.seed, a.conversations, a.turns, a.systems, a.system_words)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()
    runs = []
    for rnd in range(a.rounds):
        order = routers if rnd % 2 == 0 else routers[::-1]  # alternate: nobody always first or last
        for name in order:
            log(f"round {rnd + 1}: {name}")
            r = one_run(name, wl, a, rust_bin)
            r["round"] = rnd + 1
            log(json.dumps(r))
            runs.append(r)
    runs.sort(key=lambda r: (routers.index(r["router"]), r["round"]))
    md = table(runs, routers)
    out = {"date": started, "machine": platform.platform(), "cpus": os.cpu_count(),
           "loadavg_at_start": [round(x, 2) for x in load_start],
           "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
           "command": " ".join(["benches/real_fleet.py", *sys.argv[1:]]), "workload": {
               "conversations": a.conversations, "turns": a.turns, "systems": a.systems,
               "system_words": a.system_words, "max_tokens": a.max_tokens, "seed": a.seed},
           "shapes": {n: s.name for n, s in NODES.items()}, "runs": runs, "table": md}
    print(md)
    if a.save:
        Path(a.save).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
