"""Flow control when a router dies holding queued requests (issue 30's chaos case):
tests/chaos/flowkill.py's scenario, repeated. Two routers, one 4-slot MI300X sim at 20x real
time, `[flow] hold_when_full`: 4 long requests fill the node, 6 `standard` then 6 `critical`
short ones wait in the saturation queue (each router holding a window of it), then a router
holding critical entries is killed with SIGKILL. Reported per run: the queued requests answered
(once each, none lost, none twice), the order they left the queue in (C critical, s standard)
and when, in seconds after the kill. The preferred victim alternates; it is started again
between runs. tests/chaos/test_chaos_flow.py asserts the same on two runs.

    python benches/flow_chaos.py --runs 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "chaos"))
import flowkill  # noqa: E402
import flowstack  # noqa: E402
from zmlcore.runtime.launch import free_port, start_nats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    broker = start_nats("127.0.0.1", port, tempfile.mkdtemp(prefix="flow-chaos-"))
    stack = flowstack.launch(f"nats://127.0.0.1:{port}", Path(tempfile.mkdtemp(prefix="flow-chaos-stack-")))
    try:
        for r in range(args.runs):
            run = asyncio.run(flowkill.one_run(stack, f"{os.getpid()}-{r}", flowstack.ROUTERS[(r + 1) % 2]))
            print(f"run {r}: {run.summary()}", flush=True)
            flowkill.restart(stack, run.victim)
    finally:
        stack.stop()
        broker.stop()


if __name__ == "__main__":
    main()
