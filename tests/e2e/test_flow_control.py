"""Flow control on a live stack (zmlcore.flowctl through the routers, docs/routing.md "Flow
control"): tests/flowstack.py's stack, one node of 4 sequence slots, two routers, [flow]
hold_when_full, a policy that queues on saturation. Tenants are API keys as the gateway names
them (``Zml-Owner`` on its subject; an open broker lets the test publish there as a gateway would).

- an unattainable SLO is refused at once with SLO_UNATTAINABLE, over HTTP, raw NATS and the SDK;
- a band above the caller's ceiling is lowered and the reply says so; targets are predicted;
- a high-band request overtakes a low-band burst waiting in the saturation queue;
- a flooding tenant does not take the fleet from a steady one: the steady tenant waits for the
  next free slot, not behind the flood's queue.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import nats
import pytest

import flowstack
import zml
from conftest import MODEL, Stack
from flowstack import body
from zml_router.queue.jetstream import BUSY_TTL_S
from zmlcore import subjects


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = flowstack.launch(own_nats, tmp_path_factory.mktemp("flow"))
    try:
        yield s
    finally:
        s.stop()


async def front_door(nc: nats.NATS, tenant: str, rid: str, max_tokens: int, **extra: str) -> tuple[float, dict, dict]:
    """A request as the gateway sends it for API key ``tenant``: (seconds, reply headers, body)."""
    headers = {subjects.H_REQUEST_ID: rid, subjects.H_TIMEOUT_MS: "30000", subjects.H_OWNER: f"key:{tenant}", **extra}
    t = time.monotonic()
    msg = await nc.request(subjects.FRONT_DOOR_INFER, body(max_tokens), timeout=35, headers=headers)
    return time.monotonic() - t, dict(msg.headers or {}), json.loads(msg.data)


def test_an_unattainable_slo_is_refused_at_once_with_the_code(stack: Stack) -> None:
    # No node decodes at 10 us per token, even idle (the sims run 20x real time): refused before any node runs, no Retry-After.
    t = time.monotonic()
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=body(8),
                   headers={"content-type": "application/json", "x-zml-tpot-slo-ms": "0.01"}, timeout=10)
    took = time.monotonic() - t
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "SLO_UNATTAINABLE" and "even idle" in err["message"]
    assert err["routing_context"]["slo"] == {"tpot_ms": 0}
    assert "retry-after" not in r.headers and took < 1.0

    async def nats_side() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            msg = await nc.request(subjects.INFER, body(8), timeout=10,
                                   headers={subjects.H_TTFT_SLO_MS: "0.001", subjects.H_REQUEST_ID: "slo-nats"})
            assert (msg.headers or {}).get(subjects.H_ERROR_CODE) == "SLO_UNATTAINABLE", msg.data
        finally:
            await nc.close()

    asyncio.run(nats_side())
    # The SDK's class for the code; no retries: SLO_UNATTAINABLE is retryable, so by default the
    # client backs off and asks again (~7.5 s here) before raising the same error.
    with zml.Client(stack.gateway_url, max_retries=0) as client:
        with pytest.raises(zml.SloUnattainableError):
            client.infer(MODEL, "hello", max_tokens=8, tpot_slo_ms=0.01)


def test_a_band_above_the_ceiling_is_lowered_and_targets_are_predicted(stack: Stack) -> None:
    async def go() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            _, h, b = await front_door(nc, "lowered", "low-1", 4, **{subjects.H_PRIORITY: "critical",
                                                                       subjects.H_PRIORITY_MAX: "standard"})
            assert h.get("Zml-Priority") == "standard" and h.get("Zml-Priority-Lowered-From") == "critical", (h, b)
            _, h, b = await front_door(nc, "slo", "slo-1", 4, **{subjects.H_TTFT_SLO_MS: "30000",
                                                                   subjects.H_TPOT_SLO_MS: "5000"})
            assert b["zml"]["slo"] == "met" and float(h["Zml-Predicted-Ttft-Ms"]) < 30000, (h, b)
            assert b["zml"]["tpot_ms"] > 0
            assert float(h["Zml-Predicted-Tpot-Ms"]) > 0 and h.get("Zml-Ttft-Slo-Ms") == "30000.0"
        finally:
            await nc.close()

    asyncio.run(go())
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", content=body(4),
                   headers={"content-type": "application/json", "x-zml-priority": "sheddable"}, timeout=10)
    assert r.status_code == 200 and r.headers["x-zml-priority"] == "sheddable" and r.json()["zml"]["priority"] == "sheddable"


def test_a_high_band_request_overtakes_a_low_band_burst(stack: Stack) -> None:
    async def go() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            tb = time.monotonic()
            # waves of ~0.6 s: a loaded box's scheduling jitter (tens of ms) stays small beside them
            burst = [asyncio.create_task(front_door(nc, "burst", f"burst-{i}", 600)) for i in range(12)]
            await asyncio.sleep(0.3)  # 4 running (for ~0.6 s), 8 waiting in the saturation queue
            t0 = time.monotonic()
            took, h, b = await front_door(nc, "vip", "vip-1", 600, **{subjects.H_PRIORITY: "critical"})
            vip_done = t0 + took
            assert h.get("Zml-Priority") == "critical" and subjects.H_ERROR_CODE not in h, (h, b)
            results = await asyncio.gather(*burst)
            assert all(subjects.H_ERROR_CODE not in hh for _, hh, _ in results), results
            # 8 of the burst waited in the queue before it came; it takes the next free slot (with
            # 3 of them, the slots freeing together), so the 5 after that wave end after it. In
            # arrival order it would have been last. Waiting an extra wave, it ends with the third
            # (4 later at most): so it did while the two routers each sent the burst to all 4
            # slots before hearing of the other's sends (8 sent, 4 in the engine's own queue).
            ends = sorted(tb + t for t, _, _ in results)
            later = sum(1 for t in ends if t > vip_done)
            assert later >= 5, (took, [round(t - tb, 3) for t in ends], round(vip_done - tb, 3))
        finally:
            await nc.close()

    asyncio.run(go())


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (sorted), interpolated between the two nearest ranks (numpy's
    default)."""
    i = q * (len(xs) - 1)
    lo = int(i)
    return xs[lo] if lo + 1 >= len(xs) else xs[lo] + (i - lo) * (xs[lo + 1] - xs[lo])


def test_a_flooding_tenant_does_not_take_the_fleet_from_a_steady_one(stack: Stack) -> None:
    """The issue's live target: the steady tenant's p99 time to first token beside the flood ≤
    its p99 alone + one mean slot turnover, each measured in this run. The time to first token
    is the routers' (its wait in the saturation queue, if any, plus from the router taking the
    request to its first token: the reply's ``queued_ms`` and ``time_to_first_token``): what
    flow control decides, without the test's own client and NATS hops, which the flood's load
    on a 2-core box stretches by tens of ms beside the flood and not alone."""
    # p99 of 100: the second slowest, nearly. (Of 20 it was nearly the slowest: one request
    # stalled by the loaded box, alone as beside the flood, decided the run.)
    n = 100
    # The node at a quarter of the stack's usual speed (its simulated time 5x real, not 20x): a
    # flood request holds a slot ~0.75 s and a slot frees every ~0.25 s. At 20x the flood's own
    # token relaying loaded the 2-core box enough that, beside other work (load 10-19), its
    # processes stalled 0.1-0.4 s now and then, alone as beside the flood, against a turnover of
    # 0.07 s; and the flood's tokens per second are a quarter. What the test tells apart stays
    # apart: a steady request that found the reserve taken waited up to a whole flood request
    # (3 turnovers), one behind the flood's queue for seconds.
    sim = stack.sim_url(flowstack.FLEET[0][0]) + "/sim/profile"
    scale = httpx.get(sim, timeout=5).json()["time_scale"]
    httpx.post(sim, json={"time_scale": 5.0}, timeout=5).raise_for_status()

    async def steady(nc: nats.NATS, tag: str) -> tuple[list[float], list[float]]:
        ttft, took = [], []
        for i in range(n):
            t, h, b = await front_door(nc, "steady", f"steady-{tag}-{i}", 8)
            assert subjects.H_ERROR_CODE not in h, (h, b)
            ttft.append((b["zml"].get("queued_ms") or 0) / 1000 + b["zml"]["time_to_first_token"])
            took.append(t)
            await asyncio.sleep(0.02)
        return sorted(ttft), sorted(took)

    async def flood(nc: nats.NATS, stop: asyncio.Event, k: int, ends: list[float]) -> list[float]:
        out, i = [], 0
        while not stop.is_set():
            took, h, _ = await front_door(nc, "flood", f"flood-{k}-{i}", 200)
            out.append(took)
            ends.append(time.monotonic())
            i += 1
        return out

    async def go() -> None:
        nc = await nats.connect(stack.nats_url)
        try:
            # Alone means alone: an earlier test's (or run's) queue announcements have lapsed, so
            # the steady tenant's requests go straight to the node rather than through the queue.
            await asyncio.sleep(BUSY_TTL_S)
            alone, alone_took = await steady(nc, "alone")
            stop = asyncio.Event()
            ends: list[float] = []
            flooders = [asyncio.create_task(flood(nc, stop, k, ends)) for k in range(10 * flowstack.SLOTS)]
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            beside, took = await steady(nc, "flood")
            t1 = time.monotonic()
            stop.set()
            floods = sorted(sum(await asyncio.gather(*flooders), []))
            # One mean slot turnover: how often a slot freed on the node while the steady tenant
            # ran beside the flood (the flood's requests ending then; ~0.25 s: 200 tokens at the
            # sim's 5x hold a slot ~0.75 s, and the flood keeps 3 of the 4 busy).
            freed = sum(1 for t in ends if t0 <= t <= t1)
            turnover = (t1 - t0) / max(1, freed)
            print(f"steady TTFT alone p50/p99 {pct(alone, 0.5):.3f}/{pct(alone, 0.99):.3f} s, beside the flood "
                  f"{pct(beside, 0.5):.3f}/{pct(beside, 0.99):.3f} s (max {beside[-1]:.3f}); turnover {turnover:.3f} s "
                  f"({freed} freed); client's whole request alone p99 {pct(alone_took, 0.99):.3f} s, beside "
                  f"{pct(took, 0.99):.3f} s; flood median {pct(floods, 0.5):.3f} s over {len(floods)}")
            # It waits for the next free slot at most, never behind the flood's queue (whole seconds).
            assert pct(beside, 0.99) <= pct(alone, 0.99) + turnover, (alone, beside, turnover)
            assert pct(took, 0.99) < pct(floods, 0.5) / 4, (took, pct(floods, 0.5))
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    finally:
        httpx.post(sim, json={"time_scale": scale}, timeout=5).raise_for_status()
