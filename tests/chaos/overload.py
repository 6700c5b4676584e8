"""Overload at 150% of the fleet's capacity, then back to 50%: the excess is shed at once with
QUEUE_FULL + Retry-After, nothing hangs or is lost, and once the load drops every request
completes again within seconds. Goodput and slot occupancy are measured and recorded.

Capacity is the sims' own model (``SimProfile.capacity_rps`` at the requests' mean lengths, times
``time_scale``, summed over the fleet): what the nodes can do, not what this box's CPU can push.
Requests are open-loop Poisson arrivals, a quarter streamed. Run by test_chaos_processes.py on its
stack (sims with 4 slots each at time_scale 2.5, routers shedding beyond a 2 s TTFT estimate).
"""

from __future__ import annotations

import asyncio
import time


from chaosload import Load, LoadGen, Report, record
from chaosstack import FLEET, ChaosStack
from conftest import MODEL
from zmlcore.fleet.perfmodel import SimProfile


TIME_SCALE = 2.5
MAX_CONCURRENCY = 4
# The reference workload's mean lengths (816-token prompts, 274-token outputs): the routers'
# TTFT estimate assumes them for requests already queued, so the admission bound means what it
# says. (With 2-token prompts and 32-token outputs it overestimates queues ~8x and sheds half.)
TOKENS = (240, 308)
PROMPT_TOKENS = 816
OVER_S = 12.0
UNDER_S = 6.0


def capacity_rps() -> float:
    mean_out = sum(TOKENS) / 2
    return sum(SimProfile.for_type(acc, max_concurrency=MAX_CONCURRENCY).capacity_rps(PROMPT_TOKENS, mean_out)
               for _, acc, _ in FLEET) * TIME_SCALE


def overload_150_percent(stack: ChaosStack) -> None:
    cap = capacity_rps()
    report = Report("overload 150% of capacity, then 50%")

    occupancy: list[float] = []

    async def sample(stop: asyncio.Event) -> None:
        """Share of the fleet's slots running a request, every 0.25 s (the sims' own view)."""
        slots = MAX_CONCURRENCY * len(FLEET)
        while not stop.is_set():
            states = await asyncio.gather(*(asyncio.to_thread(stack.sim_state, n) for n, _, _ in FLEET))
            occupancy.append(sum(st["batch"]["running"] for st in states) / slots)
            await asyncio.sleep(0.25)

    async def scenario() -> float:
        # A quarter streamed, not half: parsing ~270-token streams at 10 requests/s is most of
        # what the test client costs, and on a starved 2-core box a client that falls behind
        # shows as latency that is its own.
        load = Load(stack.gateway_urls, MODEL, tokens=TOKENS, timeout_s=10.0, grace_s=10.0, seed=3, stream_share=0.25,
                    prompt_chars=4 * PROMPT_TOKENS)
        async with LoadGen(load) as lg:
            stop = asyncio.Event()
            warm = asyncio.create_task(lg.open(report, rate=1.5 * cap, duration_s=OVER_S, max_in_flight=128))
            await asyncio.sleep(3)
            sampler = asyncio.create_task(sample(stop))
            await warm
            stop.set()
            await sampler
            drop_t = time.monotonic()
            await lg.open(report, rate=0.5 * cap, duration_s=UNDER_S, max_in_flight=128)
        return drop_t

    drop_t = asyncio.run(scenario())
    t0 = report.t0
    # Goodput over the overload's steady part: completions that ended in [t0 + 3 s, drop_t].
    steady = [r for r in report.results if r.outcome == "completed" and t0 + 3 <= r.t_start + r.elapsed <= drop_t]
    goodput = len(steady) / (drop_t - t0 - 3)
    shed = [r for r in report.results if r.outcome == "error"]
    late_errors = [r for r in report.results if r.outcome != "completed" and r.t_start >= drop_t]
    last_shed = max((r.t_start for r in shed if r.t_start >= drop_t), default=drop_t)
    report.notes.update({
        "capacity_rps": round(cap, 2), "offered_rps": round(1.5 * cap, 2),
        "goodput_rps": round(goodput, 2), "goodput_share": round(goodput / cap, 3),
        "slot_occupancy": round(sum(occupancy) / max(1, len(occupancy)), 3),
        "shed_after_drop": len(late_errors), "recovered_after_s": round(last_shed - drop_t, 2),
    })
    record(report)
    report.assert_clean(min_completed=0.5)
    assert shed, report.summary()  # the excess was shed ...
    assert set(report.codes()) == {"QUEUE_FULL"}, report.summary()  # ... as QUEUE_FULL (+ Retry-After: checked)
    # Goodput (>= 95% of capacity in the issue) is recorded here but asserted by the bench
    # (`benches/soak.py --overload`): on the shared 2-core CI box the sims themselves fall behind
    # their modelled speed when the CPU is starved (83-99% measured, docs/reliability.md).
    # Recovery within seconds: requests sent 3 s after the load dropped all complete.
    assert all(r.outcome == "completed" for r in report.results if r.t_start >= drop_t + 3), report.summary()
