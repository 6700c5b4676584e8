#!/usr/bin/env python3
"""Where one request's CPU goes in the router, stage by stage, without a profiler's inflation.

cProfile (benches/peers_path.py --cprofile) charges every Python call alike, so a path of many
small calls looks costlier than it is; py-spy misattributes on an oversubscribed box. Here a
snapshot of a ZML commit gets stamps (``time.thread_time_ns``: the router's own CPU, not wall
time) at the boundaries of the request path's stages that run without waiting (intake,
prepare, decide, the attempt's set-up, the node's reply parsed, the reply assembled and
published, the end), the whole stack runs (stub node, nats-server, health, router, gateway) under
wrk at C=64, and each stage's mean CPU per request is printed beside the router's total per
request from /proc. What no stamp covers (nats-py reading and parsing messages, the event loop,
task steps, writes) is the difference. The stamps cost ~1 us each (a clock_gettime call).

    python benches/router_stages.py --harness ../shared/peers --harness-python $SETUP/venv-harness/bin/python

The stamps are applied by anchors to the snapshot only (never to the working tree); an anchor
that no longer matches exactly once stops the script with its name. Every process is started
and stopped by PID; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from peers_path import ZML_STACK, ZML_TOML_1  # noqa: E402  (the launcher: nats-server, health, router, gateway)

STAMPS = '''"""Bench instrumentation (benches/router_stages.py): the router's CPU per stage of a request."""
import json, os, time
now = time.thread_time_ns
T = 0
SUMS = {}
COUNTS = {}
_n = [0]


def add(stage, t0):
    SUMS[stage] = SUMS.get(stage, 0) + now() - t0
    COUNTS[stage] = COUNTS.get(stage, 0) + 1


def request_done():
    _n[0] += 1
    if _n[0] % 500 == 0:
        with open(os.environ["ZML_STAGES_OUT"], "w") as f:
            json.dump({k: [SUMS[k], COUNTS[k]] for k in SUMS}, f)
'''

#: (file under services/router/src/zml_router, anchor, replacement): each anchor must match once.
PATCHES = [
    ("service.py", "from zml_router.timers import Wheel\n",
     "from zml_router.timers import Wheel\nfrom zml_router import _stages as ST\n"),
    ("service.py", "        self.spawn(self.enter(msg))\n",
     "        _s = ST.now()\n        self.spawn(self.enter(msg))\n        ST.add('0 the NATS message made the request task', _s)\n"),
    ("service.py", "        t0 = time.monotonic()\n        out = Outcome()\n",
     "        _s = ST.now()\n        t0 = time.monotonic()\n        out = Outcome()\n"),
    ("service.py", "            REQUEST_ID.set(arrived.request_id)  # on every log line of this request (JSON logs)\n",
     "            REQUEST_ID.set(arrived.request_id)  # on every log line of this request (JSON logs)\n"
     "            ST.add('1 intake: headers, body decoded, id, timeout, owner, in-flight entry', _s)\n"),
    ("service.py", "                with self.timers.deadline(arrived.timeout):\n                    await self._route(msg, arrived, t0, out)\n",
     "                _s = ST.now()\n                with self.timers.deadline(arrived.timeout):\n"
     "                    ST.add('2 id claim, plan limits, deadline armed', _s)\n"
     "                    await self._route(msg, arrived, t0, out)\n                _s = ST.now()\n"),
    ("service.py", "        req, model = arrived.req, arrived.model\n",
     "        _s = ST.now()\n        req, model = arrived.req, arrived.model\n"),
    ("service.py", "        steps = route.route(plan, out)\n",
     "        steps = route.route(plan, out)\n"
     "        ST.add('3 prepare: session, policy, prompt keys, bodies, flow note, answer record, plan', _s)\n"),
    ("service.py", "                        result = self.metrics.decide(self.admit_batch if batch else decide, rr, policy)\n",
     "                        _s = ST.now()\n"
     "                        result = self.metrics.decide(self.admit_batch if batch else decide, rr, policy)\n"
     "                        ST.add('4 decide: policy admission on the table, metrics', _s)\n"),
    ("service.py", "                result = await self.relay.attempt(msg, req, bodies, model, action, arrived.request_id, t0, out,\n",
     "                ST.T = ST.now()\n"
     "                result = await self.relay.attempt(msg, req, bodies, model, action, arrived.request_id, t0, out,\n"),
    ("service.py", "            except StopIteration:\n                return\n",
     "            except StopIteration:\n                ST.add('8 after the reply: speed sample, the flow to its end', ST.T)\n                return\n"),
    ("service.py", "            self.events.add(completed_encoder.encode(ev))\n",
     "            self.events.add(completed_encoder.encode(ev))\n        if out.ok:\n"
     "            ST.add('9 finish: deadline off, claims and limits released, metrics, completion event', _s)\n"
     "            ST.request_done()\n"),
    ("node/relay.py", "from zml_router.timers import Stalled, Wheel\n",
     "from zml_router.timers import Stalled, Wheel\nfrom zml_router import _stages as ST\n"),
    ("node/relay.py", "            try:\n                sse = await post_streamed(\n",
     "            ST.add('5 attempt set-up: routing info, decision log, node body, deadlines, counts', ST.T)\n"
     "            try:\n                sse = await post_streamed(\n"),
    ("node/relay.py", "            data = got[0] if len(got) == 1 else b\"\".join(got)\n",
     "            _s = ST.now()\n            data = got[0] if len(got) == 1 else b\"\".join(got)\n"),
    ("node/relay.py", "                return asm.reply(model=req.model if rename is not None else None), asm.counts()\n",
     "                r = asm.reply(model=req.model if rename is not None else None), asm.counts()\n"
     "                ST.add('6 the reply assembled from the node stream', _s)\n                return r\n"),
    ("node/relay.py", "            raw, counts = await self._assembled(req, body, info, t0, first_byte, rename, answer, asm, placed)\n",
     "            raw, counts = await self._assembled(req, body, info, t0, first_byte, rename, answer, asm, placed)\n"
     "            _r = ST.now()\n"),
    ("node/relay.py", "        return usage\n\n    async def _whole(",
     "        if asm is not None:\n            ST.add('7 the reply: usage, metrics, routing metadata, published', _r)\n"
     "        ST.T = ST.now()\n        return usage\n\n    async def _whole("),
    ("node/client.py", "from urllib.parse import urlsplit\n",
     "from urllib.parse import urlsplit\nfrom zml_router import _stages as ST\n"),
    ("node/client.py", "        t = self.target(url)\n        head = ",
     "        _s = ST.now()\n        t = self.target(url)\n        head = "),
    ("node/client.py", "                conn.transport.write(head + body)  # type: ignore[union-attr]\n",
     "                _w = ST.now()\n"
     "                conn.transport.write(head + body)  # type: ignore[union-attr]\n"
     "                ST.add('5a2 of which the write to the node socket', _w)\n"
     "                ST.add('5a the node request: head built, connection taken, written', _s)\n"),
    ("node/client.py", "            conn = await self._acquire(t, fresh)\n            conn._new_reply(whole, limit)\n",
     "            _a = ST.now()\n            ST.add('5a0 (head built)', _s)\n"
     "            conn = await self._acquire(t, fresh)\n            ST.add('5a1 (connection taken)', _a)\n            conn._new_reply(whole, limit)\n"),
    ("node/client.py", "        def factory() -> Conn:\n",
     "        ST.add('5x new connections (count)', ST.now())\n\n        def factory() -> Conn:\n"),
    ("node/conn.py", "import httptools\n", "import httptools\nfrom zml_router import _stages as ST\n"),
    ("node/conn.py", "    def data_received(self, data: bytes) -> None:\n        self.got_bytes = True\n",
     "    def data_received(self, data: bytes) -> None:\n        _s = ST.now()\n        try:\n"
     "            self._data_received(data)\n        finally:\n"
     "            ST.add('5b the node reply bytes parsed (httptools callbacks)', _s)\n\n"
     "    def _data_received(self, data: bytes) -> None:\n        self.got_bytes = True\n"),
]

BODY = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}]}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def snapshot(ref: str, root: str) -> str:
    """The commit's files in ``root`` with the stamps applied; returns its PYTHONPATH."""
    arch = subprocess.run(["git", "-C", REPO, "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=arch, check=True)
    pkg = os.path.join(root, "services", "router", "src", "zml_router")
    with open(os.path.join(pkg, "_stages.py"), "w") as f:
        f.write(STAMPS)
    for name, anchor, repl in PATCHES:
        path = os.path.join(pkg, name)
        src = open(path).read()
        if src.count(anchor) != 1:
            raise SystemExit(f"{name}: anchor {anchor.strip()[:60]!r} found {src.count(anchor)} times")
        open(path, "w").write(src.replace(anchor, repl))
    dirs = [os.path.join(root, d, sub, "src") for d in ("libs", "services") for sub in sorted(os.listdir(os.path.join(root, d)))]
    return os.pathsep.join([d for d in dirs if os.path.isdir(d)] + [os.path.join(root, "sdk", "src")])


def ticks(pid: int) -> tuple[int, int]:
    """(user, system) CPU ticks of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--harness", default=os.path.join(REPO, "..", "shared", "peers"))
    ap.add_argument("--harness-python", default=sys.executable, help="python for the harness's stub_backend.py")
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=12)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="zml-stages-")
    os.makedirs(os.path.join(work, "src"))
    pythonpath = snapshot(a.ref, os.path.join(work, "src"))
    stub_port, port = free_port(), free_port()
    cfg = os.path.join(work, "zml.toml")
    open(cfg, "w").write(ZML_TOML_1.replace("127.0.0.1:8001", f"127.0.0.1:{stub_port}"))  # peers' one-node config
    open(os.path.join(work, "zml_stack.py"), "w").write(ZML_STACK)
    out = os.path.join(work, "stages.json")
    procs = []
    try:
        procs.append(subprocess.Popen([a.harness_python, os.path.join(a.harness, "stub_backend.py"), "--port", str(stub_port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        pids = os.path.join(work, "pids.json")
        procs.append(subprocess.Popen([sys.executable, os.path.join(work, "zml_stack.py"), "--config", cfg, "--port", str(port),
                                       "--logdir", work, "--pids", pids, "--pythonpath", pythonpath],
                                      env=dict(os.environ, ZML_STAGES_OUT=out), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        t0 = time.time()
        while True:  # up: a chat completion answers 200 (health has seen the node)
            try:
                req = urllib.request.Request(url, data=BODY, headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() - t0 > 90:
                raise SystemExit("the stack did not answer within 90 s: " + work)
            time.sleep(0.25)
        env = dict(os.environ, WRK_MODEL="stub-model", WRK_STREAM="0")
        wrk = ["wrk", "-t1", f"-c{a.conc}", "--timeout", "30s", "-s", os.path.join(a.harness, "post.lua"), url]
        subprocess.run(wrk[:3] + ["-d3s"] + wrk[3:], capture_output=True, env=env)  # warm-up
        time.sleep(1.0)
        # Sums since start-up, written every 500 requests: the window's are the difference (the
        # warm-up's first requests open the connections, and a stamp around an await that
        # waits for one counts what the process did meanwhile).
        warm = json.load(open(out))
        router = json.load(open(pids))["router1"]
        before = ticks(router)
        r = subprocess.run(wrk[:3] + [f"-d{a.seconds}s"] + wrk[3:], capture_output=True, text=True, env=env)
        after = ticks(router)
        user, system = ((x - y) / os.sysconf("SC_CLK_TCK") for x, y in zip(after, before))
        used = user + system
        m = re.search(r"(\d+) requests in", r.stdout)
        n = int(m.group(1)) if m else 0
        time.sleep(1.0)
        end = json.load(open(out))
        stages = {k: ((v[0] - warm.get(k, (0, 0))[0]) / max(1, v[1] - warm.get(k, (0, 0))[1]) / 1000.0,
                      v[1] - warm.get(k, (0, 0))[1]) for k, v in end.items()}
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    total = 1e6 * used / max(1, n)
    print(f"router CPU per request: {total:.0f} us, {1e6 * system / max(1, n):.0f} of it in the kernel "
          f"({n} requests, wrk C={a.conc}, {a.seconds} s; load {os.getloadavg()[0]:.1f})")
    print("\n| stage | us per request | share | times |\n|---|---|---|---|")
    stamped = 0.0
    for name in sorted(stages):
        us = stages[name][0]
        stamped += us
        print(f"| {name} | {us:.1f} | {100 * us / total:.0f}% | {stages[name][1]} |")
    print(f"| the rest: nats-py's reads and parsing, the event loop, task steps, timers, the kernel | {total - stamped:.1f} | "
          f"{100 * (total - stamped) / total:.0f}% |")


if __name__ == "__main__":
    main()
