"""The sim engine against its performance model, in short real time (time_scale)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from zml_sim.engine import (
    DEFAULT_MODEL_GIB,
    KV_BYTES_PER_TOKEN,
    OUTPUT_MAX,
    Faults,
    SimEngine,
    SimError,
    filler_text,
    token_text,
)
from zmlcore.fleet.perfmodel import SimProfile

M = "m"


async def make_engine(time_scale: float = 1.0, seed: int = 0, **overrides: float | int) -> SimEngine:
    overrides.setdefault("load_time_s", 0.0)
    engine = SimEngine("n1", SimProfile.for_type("nvidia_h100", **overrides), time_scale=time_scale, seed=seed)
    engine.start()
    engine.load(M)
    await engine.wait_loaded(M)
    return engine


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    eng = await make_engine(time_scale=2.0)
    yield eng
    await eng.stop()


def close_to(actual: float, expected: float, rel: float = 0.25, abs_: float = 0.03) -> bool:
    # Never faster than the model; slower only by scheduling noise (CI machines are busy).
    return expected * 0.97 - 0.002 <= actual <= expected + max(rel * expected, abs_)


async def test_ttft_of_a_lone_request_is_its_prefill_time(engine: SimEngine) -> None:
    req = engine.submit(M, prompt_tokens=2000, max_tokens=2)
    await req.text()
    expected = engine.profile.prefill_seconds(2000) / engine.time_scale  # 100 ms
    assert req.first_token_at is not None
    assert close_to(req.first_token_at - req.arrival, expected)


async def test_batch_decodes_at_the_batched_rate() -> None:
    eng = await make_engine(time_scale=2.0)
    try:
        batch, n = 8, 30
        reqs = [eng.submit(M, prompt_tokens=1, max_tokens=n) for _ in range(batch)]
        await asyncio.gather(*(r.text() for r in reqs))
        firsts = [r.first_token_at for r in reqs if r.first_token_at is not None]
        end = max(r.finished_at for r in reqs if r.finished_at is not None)
        expected = (n - 1) * eng.profile.decode_step_seconds(batch) / eng.time_scale
        # From the last first token: slower only by noise. From the earliest: never faster (on a
        # loaded box the last first token can be stamped late and the paced steps then catch up).
        assert end - max(firsts) <= expected + max(0.25 * expected, 0.03)
        assert end - min(firsts) >= expected * 0.97 - 0.002
        # Batching: per-sequence speed falls by 2% per extra sequence.
        assert eng.profile.decode_step_seconds(batch) > eng.profile.decode_step_seconds(1)
    finally:
        await eng.stop()


async def test_grouped_steps_keep_the_rate_at_high_time_scale() -> None:
    eng = await make_engine(time_scale=100.0)
    try:
        req = eng.submit(M, prompt_tokens=1000, max_tokens=1200)
        text = await req.text()
        expected = (eng.profile.prefill_seconds(1000) + 1199 * eng.profile.decode_step_seconds(1)) / 100
        assert req.finished_at is not None
        assert close_to(req.finished_at - req.arrival, expected)
        assert len(text.split()) == 1200  # "[n1]" plus 1199 words
    finally:
        await eng.stop()


async def test_request_beyond_max_concurrency_waits_for_a_slot() -> None:
    eng = await make_engine(time_scale=4.0, max_concurrency=2)
    try:
        first = [eng.submit(M, prompt_tokens=10, max_tokens=8) for _ in range(2)]
        third = eng.submit(M, prompt_tokens=10, max_tokens=8)
        await asyncio.sleep(0.02)
        assert eng.running == 2 and len(eng.waiting) == 1 and third.state == "waiting"
        await asyncio.gather(*(r.text() for r in [*first, third]))
        done = min(r.finished_at for r in first if r.finished_at is not None)
        assert third.first_token_at is not None and third.first_token_at >= done
    finally:
        await eng.stop()


async def test_prefills_run_one_at_a_time_in_fifo_order(engine: SimEngine) -> None:
    reqs = [engine.submit(M, prompt_tokens=1000, max_tokens=1) for _ in range(3)]
    await asyncio.gather(*(r.text() for r in reqs))
    ttfts = [r.first_token_at - r.arrival for r in reqs if r.first_token_at is not None]
    one = engine.profile.prefill_seconds(1000) / engine.time_scale  # 50 ms
    assert ttfts == sorted(ttfts)
    assert close_to(ttfts[2], 3 * one)


async def test_output_length_is_max_tokens_and_text_names_the_node(engine: SimEngine) -> None:
    req = engine.submit(M, prompt_tokens=5, max_tokens=7)
    text = await req.text()
    assert req.generated == 7 and req.finish_reason == "length"
    assert text.startswith("[n1] ")
    assert text == filler_text("n1", 0, 7)
    assert len(text.split()) == 7
    assert token_text("n1", 0) == "[n1] "


async def test_sampled_output_lengths_are_seeded_lognormal() -> None:
    a = SimEngine("a", SimProfile.for_type("nvidia_h100"), seed=3)
    b = SimEngine("b", SimProfile.for_type("nvidia_h100"), seed=3)
    la = [a.output_length(None) for _ in range(2000)]
    lb = [b.output_length(None) for _ in range(2000)]
    assert la == lb
    lengths = sorted(n for n, _ in la)
    assert all(reason == "stop" for _, reason in la)
    assert 1 <= lengths[0] and lengths[-1] <= OUTPUT_MAX
    assert 170 <= lengths[len(lengths) // 2] <= 230  # median 200


async def test_fault_sampling_is_reproducible_with_a_seed() -> None:
    def draws(seed: int) -> list[bool]:
        eng = SimEngine("x", SimProfile.for_type("nvidia_h100"), seed=seed,
                        faults=Faults(error_rate=0.5, drop_mid_stream=0.3))
        return [eng.sample_error() or eng.sample_drop() for _ in range(200)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert 0.45 < sum(draws(7)) / 200 < 0.85


async def test_cancel_frees_the_slot() -> None:
    eng = await make_engine(time_scale=4.0, max_concurrency=1)
    try:
        long = eng.submit(M, prompt_tokens=1, max_tokens=2000)
        queued = eng.submit(M, prompt_tokens=1, max_tokens=3)
        await asyncio.sleep(0.02)
        assert queued.state == "waiting"
        eng.cancel(long)
        assert await asyncio.wait_for(queued.text(), 2.0)
        assert long.state == "cancelled" and eng.running == 0
    finally:
        await eng.stop()


async def test_loading_takes_load_time_and_requests_need_a_loaded_model() -> None:
    eng = SimEngine("n1", SimProfile.for_type("nvidia_h100", load_time_s=10.0), time_scale=100.0)
    eng.start()
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert eng.load(M) and not eng.load(M)
        with pytest.raises(SimError):
            eng.submit(M, 1, 1)
        await eng.wait_loaded(M)
        assert 0.1 <= loop.time() - t0 < 0.3
        assert M in eng.models
        assert eng.unload(M) and not eng.models
    finally:
        await eng.stop()


async def test_memory_and_kv_accounting(engine: SimEngine) -> None:
    assert engine.free_memory_gib == pytest.approx(80.0 - DEFAULT_MODEL_GIB)
    cap = engine.kv_capacity_tokens
    assert cap == int((80.0 - DEFAULT_MODEL_GIB) * 1024**3 / KV_BYTES_PER_TOKEN)
    req = engine.submit(M, prompt_tokens=8000, max_tokens=500)
    await asyncio.sleep(0.05)
    assert engine.kv_used_tokens >= 8000
    assert engine.kv_cache_usage == pytest.approx(engine.kv_used_tokens / cap)
    assert engine.free_memory_gib < 80.0 - DEFAULT_MODEL_GIB
    engine.cancel(req)
    assert engine.kv_used_tokens == 0
    with pytest.raises(SimError):
        engine.load("huge", size_gib=100.0)


async def test_slowdown_stretches_durations() -> None:
    eng = await make_engine(time_scale=2.0)
    eng.faults = Faults(slowdown=2.0)
    try:
        req = eng.submit(M, prompt_tokens=1000, max_tokens=1)
        await req.text()
        assert req.first_token_at is not None
        assert close_to(req.first_token_at - req.arrival, 2 * 0.1 / 2)
    finally:
        await eng.stop()


async def test_stats_count_tokens_and_latencies(engine: SimEngine) -> None:
    await engine.submit(M, prompt_tokens=40, max_tokens=5).text()
    stats = engine.stats[M]
    assert stats.prompt_tokens == 40 and stats.generation_tokens == 5
    assert stats.success["length"] == 1
    assert stats.ttft.count == 1 and stats.e2e.count == 1 and stats.e2e.sum >= stats.ttft.sum


def test_fault_updates_validate() -> None:
    f = Faults().updated({"error_rate": 0.5, "crash": {"for_s": 2}, "retry_after_s": 3})
    assert f.error_rate == 0.5 and f.crash and f.crash_for_s == 2.0 and f.retry_after_s == 3.0
    assert not f.updated({"crash": False}).crash
    for bad in ({"error_rate": 2}, {"slowdown": 0.5}, {"nope": 1}, {"hang": "yes"}, {"error_status": 200}):
        with pytest.raises(ValueError):
            Faults().updated(bad)
