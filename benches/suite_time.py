"""The default test suite's time, per file: wall, setup, CPU, on which xdist process.

    python benches/suite_time.py                 # runs `python -m pytest` (the README's command)
    python benches/suite_time.py -- tests/e2e    # any pytest arguments after --
    python benches/suite_time.py --report DIR    # the table again from a run's records

Each xdist process records, per test, when it started and ended and the CPU seconds of the
process and of its children reaped meanwhile (the services a test starts and stops); a stack
that outlives its tests (a module's or the session's) is counted at the test where it is
stopped. The box's load is recorded at each test's start: on a shared 2-core box, wall times
swing with it, CPU seconds much less (docs/benchmarks.md, "Default suite time (issue 27)").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLUGIN = '''
import json, os, resource, time
_f = None
def _out():
    global _f
    if _f is None:
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _f = open(os.path.join(os.environ["SUITE_TIME_DIR"], name + ".jsonl"), "a", buffering=1)
    return _f
def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime
def pytest_runtest_logstart(nodeid, location):
    _out().write(json.dumps({"ev": "start", "id": nodeid, "t": time.time(), "cpu": _cpu(),
                             "load": os.getloadavg()[0]}) + "\\n")
def pytest_runtest_logreport(report):
    _out().write(json.dumps({"ev": report.when, "id": report.nodeid, "dur": report.duration}) + "\\n")
def pytest_runtest_logfinish(nodeid, location):
    _out().write(json.dumps({"ev": "finish", "id": nodeid, "t": time.time(), "cpu": _cpu()}) + "\\n")
'''


def report(folder: Path, top: int) -> None:
    files: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    where: dict[str, str] = {}
    loads: list[float] = []
    spans = {}
    for path in sorted(folder.glob("gw*.jsonl")) or sorted(folder.glob("main.jsonl")):
        worker = path.stem
        starts: dict[str, dict] = {}
        first, last = float("inf"), 0.0
        for line in path.read_text().splitlines():
            e = json.loads(line)
            f = e["id"].split("::", 1)[0]
            d = files[f]
            where[f] = worker
            if e["ev"] == "start":
                starts[e["id"]] = e
                d["t0"] = min(d.get("t0", float("inf")), e["t"])
                first = min(first, e["t"])
                loads.append(e["load"])
            elif e["ev"] == "finish":
                s = starts.get(e["id"])
                d["t1"] = max(d.get("t1", 0.0), e["t"])
                last = max(last, e["t"])
                if s:
                    d["cpu"] += (e["cpu"][0] - s["cpu"][0]) + (e["cpu"][1] - s["cpu"][1])
            else:
                d[e["ev"]] += e["dur"]
        spans[worker] = (first, last)
    t0 = min(a for a, _ in spans.values())
    for worker, (a, b) in sorted(spans.items()):
        print(f"{worker}: tests from {a - t0:.0f} s to {b - t0:.0f} s")
    rows = sorted(files.items(), key=lambda kv: -(kv[1]["t1"] - kv[1]["t0"]))
    print(f"\n| file | process | wall s | setup s | call s | CPU s |\n|---|---|---|---|---|---|")
    for f, d in rows[:top]:
        print(f"| {f} | {where[f]} | {d['t1'] - d['t0']:.1f} | {d['setup']:.1f} | {d['call']:.1f} | {d['cpu']:.1f} |")
    total_cpu = sum(d["cpu"] for d in files.values())
    print(f"\n{len(files)} files; CPU recorded per test {total_cpu:.0f} s; "
          f"load at test starts: median {sorted(loads)[len(loads) // 2]:.1f}, max {max(loads):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", type=Path, help="print the table of an earlier run's records")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    if args.report:
        report(args.report, args.top)
        return
    folder = Path(tempfile.mkdtemp(prefix="zml-suite-time-"))
    (folder / "suite_time_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "SUITE_TIME_DIR": str(folder),
           "PYTHONPATH": os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])}
    load0 = os.getloadavg()
    t = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_time_plugin", *args.pytest_args], env=env)
    wall = time.monotonic() - t
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\npytest exit {rc}; wall {wall:.0f} s; CPU of pytest and everything it reaped "
          f"{kids.ru_utime + kids.ru_stime:.0f} s on {os.cpu_count()} CPUs; load (1/5/15 min) "
          f"before {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, after "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}; records in {folder}")
    report(folder, args.top)
    sys.exit(rc)


if __name__ == "__main__":
    main()
