#!/usr/bin/env python3
"""Whole-path overhead of ZML (HTTP gateway -> NATS -> router -> node) vs calling the backend
directly and vs LiteLLM's proxy, measured with the shared peers harness in one run.

The harness (../shared/peers: stub_backend.py, load.py, post.lua, bench.py, configs) is NOT
part of this repo. This script copies it to a scratch directory at run time, adds ZML targets
to the copy's ``bench.py`` (``TARGETS`` entries with an argv, plus a per-process CPU split), and
runs it, so direct, LiteLLM and ZML see the same stubs, load tools, C levels and CPU accounting.

ZML targets (each one process tree, so the harness's per-tree CPU accounting covers nats-server
+ health + router(s) + gateway; the launcher itself only sleeps):
  zml1     1 node  (stub :8001), 1 router, default policy
  zml2rr   2 nodes (stubs :8001, :8002), 1 router, policy round_robin
  zml1r2   1 node, 2 router replicas (queue group)
  zml1-NAME  zml1 with a runtime variant from --zml-variants (another interpreter, nats-server's
           or the services' environment), interleaved with zml1 in the same run

Usage (from the repo root):
  # once (~3 min): venvs with the pinned harness + LiteLLM versions, and wrk
  python benches/peers_path.py --setup-dir $SCRATCH/peers_setup --setup-only
  # the matrix (~10 min), tables to stdout and <workdir>/summary.md
  python benches/peers_path.py --setup-dir $SCRATCH/peers_setup \
      --targets direct,litellm1,zml1,zml2rr --conc 1,8,32,64 --reps 2
  # where the CPU goes: py-spy on gateway and router under load.py C=32 (zml1)
  python benches/peers_path.py --setup-dir $SCRATCH/peers_setup --profile --targets zml1
  # gRPC beside HTTP: zml1 with [gateway] grpc_port, benches/grpc_load.py vs load.py on
  # zml1's HTTP port and on the stub directly, C=1 and C=64, one run
  python benches/peers_path.py --setup-dir $SCRATCH/peers_setup --grpc --conc 1,64 --reps 3
  # runtime settings interleaved in one run: nats-server with GOMAXPROCS=1, ZML on Python 3.12
  python benches/peers_path.py --setup-dir $SCRATCH/peers_setup --targets direct,zml1,zml1-g1,zml1-py312 \
      --zml-variants "g1:nats.GOMAXPROCS=1;py312:python=$SCRATCH/venv3.12/bin/python" --conc 1,64 --reps 3

Every process is started by PID and stopped by PID (the harness's Proc.stop, the launcher's
SIGTERM handler, or this script's finally: blocks). Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
import time
from collections import Counter, defaultdict

#: The shared harness: ../shared/peers from the repository root (override with --harness).
HARNESS = str(Path(__file__).resolve().parents[2] / "shared" / "peers")
ZML_PY = sys.executable  # the interpreter with zml installed (the project venv)

# --------------------------------------------------------------------------------------------
# Files generated into the scratch copy (our code, not the harness's)
# --------------------------------------------------------------------------------------------
ZML_TOML_1 = """\
[defaults]
request_timeout_s = 30
[health]
poll_interval_s = 1
[[nodes]]
id = "stub-1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:8001"
backend = "openai"
models = ["stub-model"]
"""

ZML_TOML_2RR = """\
[defaults]
request_timeout_s = 30
policy = "round_robin"
[health]
poll_interval_s = 1
[[nodes]]
id = "stub-1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:8001"
backend = "openai"
models = ["stub-model"]
[[nodes]]
id = "stub-2"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:8002"
backend = "openai"
models = ["stub-model"]
"""

# Starts nats-server + health + router(s) + gateway as children, writes their PIDs, sleeps
# until SIGTERM, then stops the children by PID (gateway first, nats last).
ZML_STACK = r'''#!/usr/bin/env python3
import argparse, json, os, signal, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--routers", type=int, default=1)
ap.add_argument("--logdir", required=True)
ap.add_argument("--pids", required=True)
ap.add_argument("--pythonpath", default="", help="ZML source snapshot dirs (os.pathsep-joined)")
ap.add_argument("--grpc-port", type=int, default=0, help="also serve zml.v1 gRPC on this port")
ap.add_argument("--nats-env", action="append", default=[], help="VAR=VALUE for nats-server only")
ap.add_argument("--env", action="append", default=[], help="VAR=VALUE for the ZML services")
a = ap.parse_args()
child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
if a.pythonpath:
    child_env["PYTHONPATH"] = a.pythonpath
child_env.update(kv.split("=", 1) for kv in a.env)
sys.path[:0] = [d for d in a.pythonpath.split(os.pathsep) if d]  # the snapshot's zmlcore, as the services
from zmlcore.runtime.launch import free_port, nats_server_binary, service_argv, wait_port
try:  # nats-server's Go settings as `zml up` sets them ([nats] server_gomaxprocs; refs before it: none)
    from zmlcore.config import load_config
    from zmlcore.runtime.sizing import nats_env as go_env, usable_cores
    go = go_env(usable_cores(), load_config(a.config).nats.server_gomaxprocs)
except ImportError:
    go = {}
nats_env = {**child_env, **go, **dict(kv.split("=", 1) for kv in a.nats_env)}
procs = []
stopping = False

def start(name, argv, env=None):
    lf = open(os.path.join(a.logdir, name + ".log"), "w")
    p = subprocess.Popen(argv, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=env or child_env)
    procs.append((name, p))
    return p

def stop_all(*_):
    global stopping
    if stopping:
        return
    stopping = True
    for name, p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for name, p in reversed(procs):
        try:
            p.wait(8)
        except subprocess.TimeoutExpired:
            p.kill()
    sys.exit(0)

signal.signal(signal.SIGTERM, stop_all)
signal.signal(signal.SIGINT, stop_all)
store = tempfile.mkdtemp(prefix="zml-nats-")
nport = free_port()
url = "nats://127.0.0.1:%d" % nport
start("nats", [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd", store], env=nats_env)
if not wait_port("127.0.0.1", nport, 15):
    stop_all()
start("health", service_argv("health", a.config, url))
prof_dir = os.environ.get("ZML_BENCH_CPROFILE")  # --cprofile: router1 and gateway under cProfile


def profiled(name, argv):
    if not prof_dir or name not in ("router1", "gateway"):
        return argv
    # argv: [python, "-m", module, ...]; CPU time, not wall time (a preempted process's wait is not its cost)
    return [argv[0], os.path.join(os.path.dirname(os.path.abspath(__file__)), "cprof_run.py"),
            os.path.join(prof_dir, name + ".prof")] + argv[2:]


for i in range(a.routers):
    start("router%d" % (i + 1), profiled("router%d" % (i + 1), service_argv("router", a.config, url, "--router-id",
                                                                         "bench-r%d" % (i + 1))))
start("gateway", profiled("gateway", service_argv("gateway", a.config, url, "--port", str(a.port),
                                                 *(["--grpc-port", str(a.grpc_port)] if a.grpc_port else []))))
with open(a.pids, "w") as f:
    json.dump({n: p.pid for n, p in procs} | {"launcher": os.getpid(), "nats_url": url}, f)
while True:
    for n, p in procs:
        if p.poll() is not None and not stopping:
            print("child %s exited rc=%s" % (n, p.returncode), flush=True)
            stop_all()
    time.sleep(0.5)
'''

# Runs ``-m MODULE ARGS`` with cProfile timed by process CPU time, off until SIGUSR1 and written
# at SIGUSR2 (so start-up and warm-up stay out of the profile; at exit if never stopped).
CPROF_RUN = r'''import cProfile, runpy, signal, sys, time
out, mod = sys.argv[1], sys.argv[2]
sys.argv = [mod] + sys.argv[3:]
prof = cProfile.Profile(time.process_time)
state = {"on": False, "done": False}


def on(*_):
    if not state["on"]:
        state["on"] = True
        prof.enable()


def off(*_):
    if state["on"] and not state["done"]:
        prof.disable()
        state["done"] = True
        prof.dump_stats(out)


signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
try:
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    off()
'''

# Imported by the patched bench.py: ZML targets, readiness by POST, per-process CPU split.
ZML_TARGETS = r'''
import json, os, socket, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ZML_PY = %(zml_py)r
ZML_PYTHONPATH = %(zml_pythonpath)r
ZML_VARIANTS = %(zml_variants)r


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _target(name, config, routers=1, variant=None):
    port = _free_port()
    variant = variant or {}
    argv = [variant.get("python", ZML_PY), os.path.join(HERE, "zml_stack.py"), "--config", os.path.join(HERE, config),
            "--port", str(port), "--routers", str(routers), "--logdir", os.path.join(HERE, "logs"),
            "--pids", os.path.join(HERE, "logs", name + ".pids.json"),
            "--pythonpath", variant.get("pythonpath", ZML_PYTHONPATH)]
    argv += [arg for kv in variant.get("nats_env", ()) for arg in ("--nats-env", kv)]
    argv += [arg for kv in variant.get("env", ()) for arg in ("--env", kv)]
    return dict(config=None, argv=argv, url="http://127.0.0.1:%%d/v1/chat/completions" %% port)


ZML_TARGETS = {
    "zml1": _target("zml1", "zml_1node.toml"),
    "zml2rr": _target("zml2rr", "zml_2node_rr.toml"),
    "zml1r2": _target("zml1r2", "zml_1node.toml", routers=2),
}
ZML_TARGETS.update({"zml1-" + vname: _target("zml1-" + vname, "zml_1node.toml", variant=v)
                    for vname, v in ZML_VARIANTS.items()})

BODY = json.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 16, "stream": False}).encode()


def wait_post(url, timeout=90.0):
    """Seconds until a chat completion through the gateway answers 200."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            req = urllib.request.Request(url, data=BODY, headers={
                "content-type": "application/json", "authorization": "Bearer sk-bench"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200 and b'"choices"' in r.read():
                    return time.time() - t0
        except Exception:
            pass
        time.sleep(0.25)
    raise RuntimeError("timeout waiting for a 200 from " + url)


def _name(pid):
    try:
        with open("/proc/%%d/cmdline" %% pid, "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for key, name in (("nats-server", "nats"), ("zml_gateway", "gateway"), ("zml_router", "router"),
                      ("zml_health", "health"), ("zml_stack", "launcher"), ("litellm", "litellm")):
        if key in cmd:
            return name
    return "other"


def split_ticks(root, descendants, proc_ticks):
    out = {}
    for pid in descendants(root):
        n = _name(pid)
        if n:
            out[n] = out.get(n, 0) + proc_ticks(pid)
    return out


def split_delta(a, b, tck):
    return {k: round((b.get(k, 0) - a.get(k, 0)) / tck, 3) for k in sorted(set(a) | set(b))}
'''

# (anchor in bench.py, replacement). Each anchor must occur exactly once.
PATCHES = [
    ("import urllib.request\n",
     "import urllib.request\n\nimport zml_targets  # added by benches/peers_path.py (ZML repo)\n"),
    ("def run_wrk(url, c, dur, model, stream):",
     "_measured_orig = measured\n\n\n"
     "def measured(fn, proxy, stubs):  # added: per-process CPU split of the proxy tree\n"
     "    s0 = zml_targets.split_ticks(proxy.pid, descendants, proc_ticks) if proxy else None\n"
     "    res = _measured_orig(fn, proxy, stubs)\n"
     "    if proxy:\n"
     "        s1 = zml_targets.split_ticks(proxy.pid, descendants, proc_ticks)\n"
     "        res['proxy_split_cpu_s'] = zml_targets.split_delta(s0, s1, TCK)\n"
     "    return res\n\n\n"
     "def run_wrk(url, c, dur, model, stream):"),
    ("\ndef litellm_env():", "\nTARGETS.update(zml_targets.ZML_TARGETS)\n\n\ndef litellm_env():"),
    ("                if t[\"config\"]:\n",
     "                if t.get(\"argv\"):  # added: ZML (whole stack under one launcher)\n"
     "                    proxy = Proc(\"%s-rep%d\" % (tname, rep), t[\"argv\"])\n"
     "                    boot_s = zml_targets.wait_post(t[\"url\"], 90)\n"
     "                    log(\"%s up in %.1fs\" % (tname, boot_s))\n"
     "                elif t[\"config\"]:\n"),
]


def log(*a):
    print("[peers_path %s]" % time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snapshot(workdir: str, ref: str, into: str = "zml-src") -> tuple[str, str]:
    """`git archive` of REF into workdir/zml-src; returns (commit, PYTHONPATH). Other engineers edit
    the working tree while benchmarks run: the services must run one fixed commit, not whatever
    the editable install sees at the moment each process starts."""
    if ref == "worktree":
        root, commit = REPO, "worktree(" + subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"],
                                                            capture_output=True, text=True).stdout.strip() + "+dirty)"
    else:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", ref], capture_output=True, text=True,
                                check=True).stdout.strip()
        root = os.path.join(workdir, into)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        arch = subprocess.run(["git", "-C", REPO, "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=arch, check=True)
    dirs = sorted(glob.glob(os.path.join(root, "libs", "*", "src")) + glob.glob(os.path.join(root, "services", "*", "src"))
                  + glob.glob(os.path.join(root, "sdk", "src")))
    return commit, os.pathsep.join(dirs)


def parse_variants(text: str) -> dict[str, dict]:
    """``NAME:SPEC;NAME:SPEC`` -> variants of zml1 (targets ``zml1-NAME``), so that runtime settings are
    compared interleaved in one run. SPEC is comma-separated: ``python=PATH`` (the interpreter of the
    ZML services: another venv), ``nats.VAR=VALUE`` (environment of nats-server only), ``VAR=VALUE``
    (environment of the ZML services)."""
    out: dict[str, dict] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, spec = part.partition(":")
        v: dict = {"nats_env": [], "env": []}
        for item in filter(None, (i.strip() for i in spec.split(","))):
            key, eq, val = item.partition("=")
            if not eq:
                raise SystemExit("--zml-variants: %r is not KEY=VALUE" % item)
            if key == "python":
                v["python"] = val
            elif key == "ref":  # another commit of this repo (before/after in one run)
                v["ref"] = val
            elif key.startswith("nats."):
                v["nats_env"].append(key[5:] + "=" + val)
            else:
                v["env"].append(item)
        out[name] = v
    return out


def prepare(workdir: str, harness: str, setup_dir: str | None, pythonpath: str = "",
            variants: dict[str, dict] | None = None) -> None:
    for pat in ("*.py", "*.lua", "*.yaml", "*.sh"):
        for f in glob.glob(os.path.join(harness, pat)):
            shutil.copy(f, workdir)
            os.chmod(os.path.join(workdir, os.path.basename(f)), 0o755)
    bench = os.path.join(workdir, "bench.py")
    src = open(bench).read()
    for anchor, repl in PATCHES:
        if src.count(anchor) != 1:
            raise SystemExit("bench.py changed: anchor %r found %d times" % (anchor, src.count(anchor)))
        src = src.replace(anchor, repl)
    open(bench, "w").write(src)
    open(os.path.join(workdir, "zml_targets.py"), "w").write(ZML_TARGETS % {"zml_py": ZML_PY, "zml_pythonpath": pythonpath,
                                                                             "zml_variants": variants or {}})
    open(os.path.join(workdir, "zml_stack.py"), "w").write(ZML_STACK)
    open(os.path.join(workdir, "cprof_run.py"), "w").write(CPROF_RUN)
    open(os.path.join(workdir, "zml_1node.toml"), "w").write(ZML_TOML_1)
    open(os.path.join(workdir, "zml_2node_rr.toml"), "w").write(ZML_TOML_2RR)
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    if setup_dir:
        for v in ("venv-harness", "venv-litellm", "venv-rust"):
            if os.path.isdir(os.path.join(setup_dir, v)) and not os.path.exists(os.path.join(workdir, v)):
                os.symlink(os.path.join(setup_dir, v), os.path.join(workdir, v))
    if not os.path.exists(os.path.join(workdir, "venv-harness")):
        log("no venvs: running setup.sh in", workdir, "(~3 min)")
        subprocess.run(["./setup.sh"], cwd=workdir, check=False)


def check_ports(ports):
    import socket
    busy = []
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                busy.append(p)
    if busy:
        raise SystemExit("ports in use (the harness needs them): %s" % busy)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------
def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float) and abs(v) >= 1000:
        return "%.0f" % v
    return ("%." + str(nd) + "f") % v


def summarize(records, tag):
    recs = [r for r in records if r.get("tag") == tag and "rps" in r]
    by = defaultdict(list)
    for r in recs:
        tool = "wrk" if r["tool"] == "wrk" else "load.py"
        by[(r["target"], tool, r["concurrency"])].append(r)
    direct = {(k[1], k[2], r["rep"]): r for k, rs in by.items() if k[0] == "direct" for r in rs}
    targets = []
    for r in recs:
        if r["target"] not in targets:
            targets.append(r["target"])
    out = []
    out.append("| target | tool | C | req/s | p50 ms | p99 ms | +p50 vs direct ms | +p99 vs direct ms "
               "| proxy CPU ms/req | proxy CPU % of 1 core | machine busy % | errors | reps |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for t in targets:
        for tool in ("wrk", "load.py"):
            for c in sorted({k[2] for k in by if k[0] == t and k[1] == tool}):
                rs = by[(t, tool, c)]
                add50 = [r["p50_ms"] - direct[(tool, c, r["rep"])]["p50_ms"] for r in rs
                         if (tool, c, r["rep"]) in direct and t != "direct"]
                add99 = [r["p99_ms"] - direct[(tool, c, r["rep"])]["p99_ms"] for r in rs
                         if (tool, c, r["rep"]) in direct and t != "direct"]
                out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |" % (
                    t, tool, c, fmt(med([r["rps"] for r in rs]), 0), fmt(med([r["p50_ms"] for r in rs])),
                    fmt(med([r["p99_ms"] for r in rs])), fmt(med(add50)), fmt(med(add99)),
                    fmt(med([r.get("proxy_cpu_ms_per_req") for r in rs])),
                    fmt(med([r.get("proxy_cpu_pct") for r in rs]), 0),
                    fmt(med([r.get("machine_busy_pct") for r in rs]), 0),
                    sum(r.get("errors", 0) or 0 for r in rs), len(rs)))
    # per-process split for ZML targets
    out.append("")
    out.append("Per-process CPU of the ZML tree, ms per request (median over reps; % = share of one core):")
    out.append("")
    names = ["gateway", "router", "nats", "health", "launcher"]
    out.append("| target | tool | C | req/s | " + " | ".join(names) + " | total |")
    out.append("|---|---|---|---|" + "---|" * (len(names) + 1))
    for t in targets:
        if not t.startswith("zml"):
            continue
        for tool in ("wrk", "load.py"):
            for c in sorted({k[2] for k in by if k[0] == t and k[1] == tool}):
                rs = by[(t, tool, c)]
                cells = []
                for n in names:
                    ms = med([1000.0 * r["proxy_split_cpu_s"].get(n, 0) / max(1, r["rps"] * r["wall_s"])
                              for r in rs if r.get("proxy_split_cpu_s")])
                    pct = med([100.0 * r["proxy_split_cpu_s"].get(n, 0) / r["wall_s"]
                               for r in rs if r.get("proxy_split_cpu_s")])
                    cells.append("%s (%s%%)" % (fmt(ms, 3), fmt(pct, 0)))
                out.append("| %s | %s | %d | %s | %s | %s |" % (
                    t, tool, c, fmt(med([r["rps"] for r in rs]), 0), " | ".join(cells),
                    fmt(med([r.get("proxy_cpu_ms_per_req") for r in rs]), 3)))
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Profile mode: py-spy on gateway and router under load
# --------------------------------------------------------------------------------------------
def top_frames(raw_path, n=15):
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    self_c, incl_c, total = Counter(), Counter(), 0
    for line in open(raw_path):
        line = line.rstrip()
        if not line:
            continue
        stack, _, cnt = line.rpartition(" ")
        cnt = int(cnt)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].split("/")[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        total += cnt
        self_c[frames[-1]] += cnt
        for f in set(frames):
            incl_c[f] += cnt
    return total, self_c.most_common(n), incl_c.most_common(n + 10)


def profile(workdir, target, conc, seconds, rate, native=False):
    pyspy = shutil.which("py-spy") or os.path.join(os.path.dirname(ZML_PY), "py-spy")
    hpy = os.path.join(workdir, "venv-harness", "bin", "python")
    sys.path.insert(0, workdir)
    import zml_targets  # noqa: E402  (generated above)

    t = zml_targets.ZML_TARGETS[target]
    procs = []
    try:
        for port in (8001, 8002):
            procs.append(subprocess.Popen([hpy, os.path.join(workdir, "stub_backend.py"), "--port", str(port)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        stack = subprocess.Popen(t["argv"], stdout=open(os.path.join(workdir, "logs", "profile-stack.log"), "w"),
                                 stderr=subprocess.STDOUT)
        procs.append(stack)
        boot = zml_targets.wait_post(t["url"], 90)
        log("%s up in %.1fs; warming up" % (target, boot))
        pids = json.load(open(os.path.join(workdir, "logs", target + ".pids.json")))
        subprocess.run([hpy, os.path.join(workdir, "load.py"), "--url", t["url"], "-c", str(conc), "-n", "2000",
                        "--max-seconds", "5"], capture_output=True)
        spies = {}
        for svc in ("gateway", "router1"):
            outp = os.path.join(workdir, "logs", "pyspy-%s.txt" % svc)
            spies[svc] = (outp, subprocess.Popen(
                [pyspy, "record", "--pid", str(pids[svc]), "--rate", str(rate), "--duration", str(seconds),
                 "--format", "raw", "--output", outp] + (["--native"] if native else ["--nonblocking"]),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
        lr = subprocess.run([hpy, os.path.join(workdir, "load.py"), "--url", t["url"], "-c", str(conc),
                             "-n", "1000000", "--max-seconds", str(seconds - 2), "--warmup", "0"],
                            capture_output=True, text=True)
        log("load during profile:", lr.stdout.strip()[-300:])
        report = ["Profile: %s, load.py C=%d, py-spy --rate %d %s, %ds (non-idle samples only)"
                  % (target, conc, rate, "--native" if native else "--nonblocking", seconds), ""]
        for svc, (outp, sp) in spies.items():
            sp.wait(seconds + 30)
            if not os.path.exists(outp):
                report.append("%s: no py-spy output (ptrace not permitted?)" % svc)
                continue
            total, selfs, incl = top_frames(outp)
            report.append("### %s: %d samples" % (svc, total))
            report.append("")
            report.append("| self % | function (file) |")
            report.append("|---|---|")
            for f, c in selfs:
                report.append("| %.1f | `%s` |" % (100.0 * c / total, f))
            report.append("")
            report.append("| inclusive % | function (file) |")
            report.append("|---|---|")
            for f, c in incl:
                if c > 0.9 * total:  # the entry-point frames every sample has (runpy, main, Runner.run)
                    continue
                report.append("| %.1f | `%s` |" % (100.0 * c / total, f))
            report.append("")
        text = "\n".join(report)
        open(os.path.join(workdir, "profile.md"), "w").write(text)
        print(text)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


#: A function each process runs once per request (its intake), by profile name: the count of
#: requests the profile saw.
_ONCE_PER_REQUEST = {"router1": ("request/intake.py", "intake"), "gateway": ("infer/intake.py", "check")}


def calls_per_request(stats, name):
    """The profile's calls per request, into ZML's own functions (coroutine steps included),
    builtins and the rest: a count that does not move with the box's load, unlike its times."""
    path, func = _ONCE_PER_REQUEST[name]
    n = sum(v[1] for (f, _, fn), v in stats.stats.items() if fn == func and f.endswith(path))
    if not n:
        return "%s: no request in the profile" % name
    own = sum(v[1] for (f, _, _), v in stats.stats.items() if "/zml-src" in f)
    builtin = sum(v[1] for (f, _, _), v in stats.stats.items() if f == "~")
    return ("%s: %d requests, %.0f calls per request (ZML's functions %.0f, builtins %.0f, other %.0f)"
            % (name, n, stats.total_calls / n, own / n, builtin / n, (stats.total_calls - own - builtin) / n))


def cprofile(workdir, target, conc, seconds, stream=False):
    """cProfile (deterministic, in-process) on router1 and the gateway under wrk at C=conc:
    py-spy's sampling misattributes time on a box whose cores are oversubscribed (a runnable
    thread waiting for a core counts as busy in whatever frame it stopped)."""
    import pstats
    hpy = os.path.join(workdir, "venv-harness", "bin", "python")
    sys.path.insert(0, workdir)
    import zml_targets  # noqa: E402  (generated above)

    t = zml_targets.ZML_TARGETS[target]
    pdir = os.path.join(workdir, "cprofile")
    os.makedirs(pdir, exist_ok=True)
    procs = []
    try:
        procs.append(subprocess.Popen([hpy, os.path.join(workdir, "stub_backend.py"), "--port", "8001"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        stack = subprocess.Popen(t["argv"], stdout=open(os.path.join(workdir, "logs", "cprofile-stack.log"), "w"),
                                 stderr=subprocess.STDOUT, env=dict(os.environ, ZML_BENCH_CPROFILE=pdir))
        procs.append(stack)
        log("%s up in %.1fs" % (target, zml_targets.wait_post(t["url"], 120)))
        env = dict(os.environ, WRK_MODEL="stub-model", WRK_STREAM="1" if stream else "0")

        def wrk(secs):
            return subprocess.run(["wrk", "-t1", "-c%d" % conc, "-d%ds" % secs, "--timeout", "30s", "-s",
                                   os.path.join(workdir, "post.lua"), t["url"]], capture_output=True, text=True, env=env)

        wrk(3)  # warm-up, outside the profile
        pids = json.load(open(os.path.join(workdir, "logs", target + ".pids.json")))
        profiled = [pids[n] for n in ("gateway", "router1") if n in pids]
        for pid in profiled:
            os.kill(pid, signal.SIGUSR1)
        r = wrk(seconds)
        for pid in profiled:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(2)
        log("wrk:", [line for line in r.stdout.splitlines() if "WRKJSON" in line or "Requests/sec" in line])
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    for name in ("gateway", "router1"):
        path = os.path.join(pdir, name + ".prof")
        if os.path.exists(path):
            print("\n### %s (cProfile, wrk C=%d%s)" % (name, conc, ", stream" if stream else ""))
            st = pstats.Stats(path)
            st.sort_stats("tottime").print_stats(30)
            print(calls_per_request(st, name))


# --------------------------------------------------------------------------------------------
# gRPC mode: zml1 over gRPC (benches/grpc_load.py) beside zml1 over HTTP and direct (load.py)
# --------------------------------------------------------------------------------------------
def _children(root):
    """PIDs of root's process tree (from /proc's ppid links)."""
    kids = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids[ppid].append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def _ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def grpc_compare(workdir, pythonpath, conc, reps, seconds, n):
    sys.path.insert(0, workdir)
    import zml_targets  # noqa: E402  (generated by prepare)

    tck = os.sysconf("SC_CLK_TCK")
    hpy = os.path.join(workdir, "venv-harness", "bin", "python")
    port, gport = zml_targets._free_port(), zml_targets._free_port()
    url = "http://127.0.0.1:%d/v1/chat/completions" % port
    argv = [ZML_PY, os.path.join(workdir, "zml_stack.py"), "--config", os.path.join(workdir, "zml_1node.toml"),
            "--port", str(port), "--grpc-port", str(gport), "--routers", "1", "--logdir", os.path.join(workdir, "logs"),
            "--pids", os.path.join(workdir, "logs", "zml1grpc.pids.json"), "--pythonpath", pythonpath]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    procs, records = [], []
    try:
        procs.append(subprocess.Popen([hpy, os.path.join(workdir, "stub_backend.py"), "--port", "8001"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        stack = subprocess.Popen(argv, stdout=open(os.path.join(workdir, "logs", "grpc-stack.log"), "w"),
                                 stderr=subprocess.STDOUT)
        procs.append(stack)
        log("zml1 (+gRPC :%d) up in %.1fs" % (gport, zml_targets.wait_post(url, 90)))
        loads = {
            "direct": [hpy, os.path.join(workdir, "load.py"), "--url", "http://127.0.0.1:8001/v1/chat/completions"],
            "zml1": [hpy, os.path.join(workdir, "load.py"), "--url", url],
            "zml1-grpc": [ZML_PY, os.path.join(REPO, "benches", "grpc_load.py"), "--target", "127.0.0.1:%d" % gport],
        }
        for rep in range(reps):
            for c in conc:
                for target, cmd in loads.items():
                    tree = _children(stack.pid)
                    split0 = {pid: _ticks(pid) for pid in tree}
                    busy0 = _busy()
                    r = subprocess.run(cmd + ["-c", str(c), "-n", str(n), "--max-seconds", str(seconds)],
                                       capture_output=True, text=True, env=env if target == "zml1-grpc" else None)
                    busy1 = _busy()
                    try:
                        res = json.loads(r.stdout.strip().splitlines()[-1])
                    except (IndexError, ValueError):
                        log("%s C=%d failed: %s" % (target, c, (r.stderr or r.stdout)[-500:]))
                        continue
                    split = defaultdict(float)
                    for pid in tree:
                        name = zml_targets._name(pid)
                        if name:
                            split[name] += (_ticks(pid) - split0[pid]) / tck
                    res.update(target=target, concurrency=c, rep=rep, tag="grpc", wall_s=res["elapsed_s"],
                               proxy_split_cpu_s=dict(split) if target != "direct" else {},
                               machine_busy_pct=round(100.0 * (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), 1))
                    done = max(1, res["ok"])
                    res["proxy_cpu_ms_per_req"] = (round(1000.0 * sum(split.values()) / done, 3)
                                                   if target != "direct" else None)
                    records.append(res)
                    log("%s C=%d rep %d: %.0f req/s p50 %.2f ms p99 %.2f ms ZML CPU %s ms/req" % (
                        target, c, rep, res["rps"], res["p50_ms"], res["p99_ms"], res["proxy_cpu_ms_per_req"]))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
    with open(os.path.join(workdir, "grpc_results.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    text = grpc_summary(records)
    open(os.path.join(workdir, "grpc_summary.md"), "w").write(text)
    print(text)


def _busy():
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def grpc_summary(records):
    by = defaultdict(list)
    for r in records:
        by[(r["target"], r["concurrency"])].append(r)
    direct = {(r["concurrency"], r["rep"]): r for r in records if r["target"] == "direct"}
    names = ["gateway", "router", "nats", "health"]
    out = ["| target | client | C | req/s | p50 ms | p99 ms | +p50 vs direct ms | ZML CPU ms/req | "
           + " | ".join(names) + " | machine busy % | errors | reps |",
           "|---|---|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|"]
    for (t, c), rs in sorted(by.items(), key=lambda kv: (kv[0][1], ["direct", "zml1", "zml1-grpc"].index(kv[0][0]))):
        add50 = [r["p50_ms"] - direct[(c, r["rep"])]["p50_ms"] for r in rs if (c, r["rep"]) in direct and t != "direct"]
        cells = [fmt(med([1000.0 * r["proxy_split_cpu_s"].get(nm, 0) / max(1, r["ok"]) for r in rs]), 3)
                 if t != "direct" else "-" for nm in names]
        out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %d | %d |" % (
            t, "grpc_load.py" if t.endswith("grpc") else "load.py", c, fmt(med([r["rps"] for r in rs]), 0),
            fmt(med([r["p50_ms"] for r in rs])), fmt(med([r["p99_ms"] for r in rs])), fmt(med(add50)),
            fmt(med([r["proxy_cpu_ms_per_req"] for r in rs]), 3), " | ".join(cells),
            fmt(med([r["machine_busy_pct"] for r in rs]), 0), sum(r.get("errors", 0) for r in rs), len(rs)))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", default=HARNESS)
    ap.add_argument("--setup-dir", help="dir where the harness's setup.sh already ran (venv-harness, venv-litellm)")
    ap.add_argument("--setup-only", action="store_true", help="run setup.sh in --setup-dir and exit")
    ap.add_argument("--workdir", help="scratch dir (default: a new temp dir)")
    ap.add_argument("--targets", default="direct,litellm1,zml1,zml2rr")
    ap.add_argument("--conc", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tools", default="wrk,load")
    ap.add_argument("--wrk-duration", type=int, default=6)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=10.0)
    ap.add_argument("--tag", default="peers_path")
    ap.add_argument("--stream", action="store_true",
                    help="streamed requests (SSE, the stub's --tokens chunks each); CPU per chunk = per request / 17")
    ap.add_argument("--zml-ref", default="HEAD",
                    help="git ref of this repo to run ZML from (snapshot via git archive); 'worktree' = as checked out")
    ap.add_argument("--profile", action="store_true", help="py-spy gateway+router instead of the matrix")
    ap.add_argument("--profile-conc", type=int, default=32)
    ap.add_argument("--profile-seconds", type=int, default=20)
    ap.add_argument("--profile-rate", type=int, default=250)
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile router1 and the gateway under wrk at --profile-conc (--stream: streamed)")
    ap.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames; pauses the target)")
    ap.add_argument("--zml-variants", default="",
                    help="NAME:SPEC;... adds targets zml1-NAME: zml1 with python=PATH (another venv's interpreter), ref=GITREF "
                         "(another commit of this repo), "
                         "nats.VAR=VALUE (nats-server's environment, e.g. nats.GOMAXPROCS=1) or VAR=VALUE (the "
                         "services' environment); list them in --targets to interleave them with zml1")
    ap.add_argument("--grpc", action="store_true",
                    help="zml1 over gRPC (benches/grpc_load.py) beside zml1 over HTTP and direct (load.py)")
    a = ap.parse_args()

    if a.setup_only:
        os.makedirs(a.setup_dir, exist_ok=True)
        prepare(a.setup_dir, a.harness, None)
        return
    workdir = a.workdir or tempfile.mkdtemp(prefix="zml-peers-")
    os.makedirs(workdir, exist_ok=True)
    commit, pythonpath = snapshot(workdir, a.zml_ref)
    variants = parse_variants(a.zml_variants)
    for vname, v in variants.items():
        if "ref" in v:
            vcommit, v["pythonpath"] = snapshot(workdir, v["ref"], "zml-src-" + vname)
            log("variant", vname, "runs ZML commit", vcommit)
    prepare(workdir, a.harness, a.setup_dir, pythonpath, variants)
    open(os.path.join(workdir, "zml_commit.txt"), "w").write(commit + "\n")
    log("workdir", workdir, "ZML commit", commit)
    check_ports([8001, 8002] + ([4000] if "litellm" in a.targets else []))
    if a.cprofile:
        cprofile(workdir, a.targets.split(",")[0], a.profile_conc, a.profile_seconds, a.stream)
        return
    if a.profile:
        profile(workdir, a.targets.split(",")[0], a.profile_conc, a.profile_seconds, a.profile_rate,
                a.profile_native)
        return
    if a.grpc:
        log("ZML commit", commit)
        grpc_compare(workdir, pythonpath, [int(c) for c in a.conc.split(",")], a.reps, a.max_seconds, a.n)
        return
    out = os.path.join(workdir, "results.jsonl")
    cmd = [os.path.join(workdir, "venv-harness", "bin", "python"), os.path.join(workdir, "bench.py"),
           "--reps", str(a.reps), "--conc", a.conc, "--targets", a.targets, "--tools", a.tools,
           "--wrk-duration", str(a.wrk_duration), "-n", str(a.n), "--max-seconds", str(a.max_seconds),
           "--tag", a.tag, "--out", out] + (["--stream"] if a.stream else [])
    log("running:", " ".join(cmd))
    env = dict(os.environ, PATH=os.path.dirname(ZML_PY) + os.pathsep + os.environ.get("PATH", ""))
    subprocess.run(cmd, cwd=workdir, env=env, check=False)
    records = [json.loads(line) for line in open(out) if line.strip()]
    text = summarize(records, a.tag)
    text = "ZML commit: %s\n\n%s" % (commit, text)
    open(os.path.join(workdir, "summary.md"), "w").write(text + "\n")
    print(text)
    log("raw records:", out, " summary:", os.path.join(workdir, "summary.md"))


if __name__ == "__main__":
    main()
