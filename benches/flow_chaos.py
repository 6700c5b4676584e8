"""Flow control when a router dies holding queued requests (issue 30's chaos case): two routers,
one 4-slot MI300X sim at 20x real time, `[flow] hold_when_full` (tests/e2e/test_flow_control.py's
stack). Each run: 4 long requests fill the node, 6 `standard` then 6 `critical` short ones wait
in the saturation queue (each router holding a window of it), then one router is killed with
SIGKILL. Reported per run: the queued requests answered (once each, none lost, none twice), and
the order the waiting ones were dispatched in (C critical, s standard; from each reply's
`queued_ms`). The victim alternates; it is started again between runs.

    python benches/flow_chaos.py --runs 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
import nats  # noqa: E402
from conftest import launch_stack  # noqa: E402
import test_flow_control as tfc  # noqa: E402
from zmlcore import subjects as S  # noqa: E402
from zmlcore.runtime.launch import free_port, start_nats  # noqa: E402


async def one_run(stack, victim: str, tag: str) -> list[tuple[str, str, int, list[str], float | None]]:  # type: ignore[no-untyped-def]
    nc = await nats.connect(stack.nats_url)
    try:
        t0 = time.monotonic()

        async def req(tenant: str, rid: str, max_tokens: int, band: str):  # type: ignore[no-untyped-def]
            sent = time.monotonic()
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            headers = {S.H_REQUEST_ID: f"{rid}-{tag}", S.H_TIMEOUT_MS: "30000", S.H_OWNER: f"key:{tenant}",
                       S.H_PRIORITY: band}
            await nc.publish(S.FRONT_DOOR_INFER, tfc.body(max_tokens), reply=inbox, headers=headers)
            replies = []
            try:  # every reply within 12 s (a second one would be a request served twice)
                while True:
                    replies.append(await sub.next_msg(timeout=12 if not replies else 1.0))
            except Exception:
                pass
            ok = [m for m in replies if S.H_ERROR_CODE not in (m.headers or {}) and m.data]
            errors = [(m.headers or {})[S.H_ERROR_CODE] for m in replies if S.H_ERROR_CODE in (m.headers or {})]
            queued_ms = json.loads(ok[0].data).get("zml", {}).get("queued_ms") if ok else None
            dispatched = None if queued_ms is None else sent - t0 + queued_ms / 1000
            return rid, band, len(ok), errors, dispatched

        hold = [asyncio.create_task(req("base", f"hold-{i}", 1500, "standard")) for i in range(4)]
        await asyncio.sleep(0.3)
        waiting = [asyncio.create_task(req("std", f"std-{i}", 8, "standard")) for i in range(6)]
        await asyncio.sleep(0.1)
        waiting += [asyncio.create_task(req("vip", f"crit-{i}", 8, "critical")) for i in range(6)]
        await asyncio.sleep(0.4)
        proc = stack.procs.pop(victim)
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)
        return list(await asyncio.gather(*hold, *waiting))
    finally:
        await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    broker = start_nats("127.0.0.1", port, tempfile.mkdtemp(prefix="flow-chaos-"))
    stack = launch_stack(f"nats://127.0.0.1:{port}", Path(tempfile.mkdtemp(prefix="flow-chaos-stack-")),
                         fleet=tfc.ONE, routers=2, extra=tfc.FLOW, sim_extra="max_concurrency = 4\n")
    try:
        for r in range(args.runs):
            victim = "router-2" if r % 2 == 0 else "router-1"
            res = asyncio.run(one_run(stack, victim, f"{os.getpid()}-{r}"))
            queued = [x for x in res if not x[0].startswith("hold")]
            order = [(x[4], x[1]) for x in queued if x[4] is not None]
            seq = "".join("C" if b == "critical" else "s" for _, b in sorted(order))
            inversions = sum(1 for i, (_, a) in enumerate(sorted(order)) for _, b in sorted(order)[i + 1:]
                             if a == "standard" and b == "critical")
            print(f"run {r} ({victim} killed): queued answered once {sum(1 for x in queued if x[2] == 1)}/12, "
                  f"lost {[x[0] for x in queued if x[2] == 0]}, twice {[x[0] for x in queued if x[2] > 1]}, "
                  f"errors {[x[3] for x in queued if x[3]]}; dispatched via the queue in order {seq} "
                  f"({inversions} standard-before-critical pairs); the 4 holding requests answered "
                  f"{sum(x[2] for x in res if x[0].startswith('hold'))} (the victim's get no answer)", flush=True)
            stack.start_router(victim)
            stack.procs[victim].wait_for("started", 30)
            time.sleep(2)
    finally:
        stack.stop()
        broker.stop()


if __name__ == "__main__":
    main()
