"""What each `zml up` process costs with no traffic: CPU and wake-ups per second.

Starts `zml up --insecure` (extra arguments are passed on: ``--config``, ``--sim-port-base``,
...), waits for its ready line and ``--settle-s`` more, then reads every child's threads from
/proc over ``--seconds``: CPU from ``schedstat`` (ns), wake-ups as voluntary + involuntary
context switches. A process that wakes every few ms at idle wastes a core's worth of wake-ups
across a fleet of replicas; the table says which does:

    python benches/idle_cost.py --seconds 30 -- --sim-port-base 17100 --gateway-port 18080 \\
        --nats-port 18222 --metrics-port 0

`zml up` is stopped with SIGTERM (it stops its children by PID).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def children(pid: int) -> list[int]:
    out: list[int] = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(k) for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def label(pid: int) -> str:
    cmd = " ".join(a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    if "nats-server" in cmd:
        return "nats-server"
    m = re.search(r"-m (zml_\w+|zmlcore\.sim)", cmd)
    return (m.group(1) if m else cmd[:40]) + f" ({pid})"


def sample(pid: int) -> tuple[int, int, int]:
    """(CPU ns, context switches, threads) of every thread of pid."""
    ns = switches = threads = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            ns += int(Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{t}/status").read_text()
        except OSError:  # a thread that just ended
            continue
        switches += sum(int(v) for v in re.findall(r"voluntary_ctxt_switches:\s+(\d+)", status))
        threads += 1
    return ns, switches, threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=10.0, help="wait after ready (start-up work ends)")
    ap.add_argument("up_args", nargs="*", help="arguments for `zml up` (after --)")
    a = ap.parse_args()
    up = subprocess.Popen([sys.executable, "-m", "zml.cli", "up", "--insecure", *a.up_args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "zml ready" in line:
                break
        else:
            raise SystemExit("zml up ended before it was ready")
        threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()  # keep its pipe drained
        time.sleep(a.settle_s)
        pids = children(up.pid)
        before = {p: sample(p) for p in pids}
        t0 = time.monotonic()
        time.sleep(a.seconds)
        dt = time.monotonic() - t0
        after = {p: sample(p) for p in pids}
        print(f"idle {dt:.0f} s, load average {os.getloadavg()[0]:.2f}")
        print("| process | CPU ms/s | wake-ups/s | threads |")
        print("|---|---|---|---|")
        total = 0.0
        for p in pids:
            cpu = (after[p][0] - before[p][0]) / 1e6 / dt
            total += cpu
            print(f"| {label(p)} | {cpu:.2f} | {(after[p][1] - before[p][1]) / dt:.1f} | {after[p][2]} |")
        print(f"| total | {total:.2f} | | |")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


if __name__ == "__main__":
    main()
