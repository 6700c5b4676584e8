from zml_health.speed import MIN_TOKENS, Readings, SpeedMeter


def test_first_reading_only_sets_the_baseline() -> None:
    m = SpeedMeter()
    m.observe(Readings(1000, 0.1, 500, 5, 10.0), running=3)
    assert m.prefill_tps is None and m.decode_tps is None


def test_decode_speed_is_brought_back_to_batch_one() -> None:
    m = SpeedMeter()
    m.observe(Readings(0, 0.0, 0, 0, 0.0), running=0)
    # 32 sequences decoding: each ran at r(32) = r(1) / (1 + 0.02 * 31).
    r1 = 60.0
    r32 = r1 / (1 + 0.02 * 31)
    m.observe(Readings(0, 0.0, 1000 + 10, 10, 1000 / r32), running=32)
    assert m.decode_tps is not None and abs(m.decode_tps - r1) < 1e-6
    assert m.prefill_tps is None  # no prefill in that window


def test_small_windows_and_counter_resets_are_ignored() -> None:
    m = SpeedMeter()
    m.observe(Readings(0, 0.0, 0, 0, 0.0), running=1)
    m.observe(Readings(MIN_TOKENS - 1, 0.001, 0, 0, 0.0), running=1)
    assert m.prefill_tps is None
    m.observe(Readings(10_000, 1.0, 0, 0, 0.0), running=1)
    first = m.prefill_tps
    assert first is not None
    m.observe(Readings(5, 0.0, 0, 0, 0.0), running=1)  # engine restarted: counters went down
    assert m.prefill_tps == first


def test_ewma_moves_towards_new_speed() -> None:
    m = SpeedMeter()
    m.observe(Readings(0, 0.0, 0, 0, 0.0), running=1)
    m.observe(Readings(10_000, 1.0, 0, 0, 0.0), running=1)
    m.observe(Readings(15_000, 2.0, 0, 0, 0.0), running=1)  # now 5,000 tok/s
    assert m.prefill_tps is not None and 5_000 < m.prefill_tps < 10_000
