"""The health score, the status state machine (flapping) and hardware validation: pure."""

from __future__ import annotations

import pytest

from zml_health.adapters.base import Probe
from zml_health.tracker import Tracker
from zmlcore.config import HealthConfig
from zml_health.hardware import validate_hardware
from zml_health.score import health_score
from zml_health.hardware import NO_PROBE_NOTE

CFG = HealthConfig(down_after=3, up_after=2, startup_grace_s=10.0)
OK = Probe(ok=True, models=["m"])
FAIL = Probe(ok=False, error="ConnectError")
SLOW = Probe(ok=False, slow=True, error="timed out")


@pytest.mark.parametrize(("e", "running", "waiting", "cap", "want"), [
    (0.0, 0, 0, 32, 100.0),
    (0.0, 32, 0, 32, 66.7),
    (0.0, 32, 32, 32, 40.0),
    (0.5, 0, 0, 32, 50.0),
    (1.0, 0, 0, 32, 0.0),
    (0.0, 16, 0, 0, 11.1),  # unknown capacity counts as 1
    (-1.0, -3, -3, 32, 100.0),  # nonsense clamps
    (2.0, 0, 0, 32, 0.0),
])
def test_score(e: float, running: int, waiting: int, cap: int, want: float) -> None:
    assert health_score(e, running, waiting, cap) == want


def test_score_is_monotonic_in_queue_and_errors() -> None:
    scores = [health_score(0.1, r, w, 16) for r, w in ((0, 0), (8, 0), (16, 0), (16, 8), (16, 32))]
    assert scores == sorted(scores, reverse=True)
    assert health_score(0.0, 4, 0, 16) > health_score(0.2, 4, 0, 16)


def feed(tr: Tracker, probes: list[Probe], t0: float = 100.0) -> list[str]:
    return [tr.observe(p, t0 + i, CFG) for i, p in enumerate(probes)]


def test_loading_during_grace_then_down() -> None:
    tr = Tracker(started_at=100.0, grace_s=10.0)
    assert feed(tr, [FAIL] * 3) == ["loading"] * 3
    assert tr.observe(FAIL, 111.0, CFG) == "down"  # grace over, never answered


def test_engine_saying_loading_is_loading() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    assert tr.observe(Probe(ok=False, loading=True), 50.0, CFG) == "loading"
    assert tr.observe(OK, 51.0, CFG) == "up"


def test_down_after_n_consecutive_failures_up_after_m_successes() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    assert feed(tr, [OK, FAIL, FAIL, FAIL, OK, OK]) == ["up", "up", "up", "down", "down", "up"]
    assert tr.fails == 0 and tr.oks == 2


def test_flapping_node_is_not_marked_down_nor_back_up_on_one_probe() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    # alternating failures never reach down_after consecutive ones
    assert set(feed(tr, [OK, FAIL, OK, FAIL, OK, FAIL, FAIL, OK])) == {"up"}
    # once down, one good probe between failures does not bring it back
    tr = Tracker(started_at=0.0, grace_s=0.0)
    assert feed(tr, [OK, FAIL, FAIL, FAIL, OK, FAIL, OK, FAIL])[-4:] == ["down"] * 4


def test_one_slow_probe_is_not_a_failure_of_the_node() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    assert feed(tr, [OK, SLOW, OK]) == ["up", "up", "up"]
    assert tr.error_rate(102.0, 60.0) == 0.0  # a timeout is not an error of the node
    assert feed(tr, [SLOW, SLOW, SLOW], t0=103.0)[-1] == "down"  # but a node that never answers is


def test_error_rate_from_probes_and_router_events() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    feed(tr, [OK, FAIL, OK, OK])  # 1 of 4 probes failed
    assert tr.error_rate(103.0, 60.0) == 0.25
    for i in range(10):
        tr.record_request(103.0, ok=i >= 5, node_error=i < 5)
    assert tr.error_rate(103.0, 60.0) == 0.5
    assert tr.error_rate(500.0, 60.0) == 0.0  # the window forgets
    assert tr.last_inference_at == 103.0


def test_rates_from_counters_and_restart() -> None:
    tr = Tracker(started_at=0.0, grace_s=0.0)
    tr.observe(Probe(ok=True, generation_tokens_total=100, requests_ok_total=10, ttft_sum=1.0, ttft_count=10),
               10.0, CFG)
    tr.observe(Probe(ok=True, generation_tokens_total=300, requests_ok_total=14, ttft_sum=3.0, ttft_count=14),
               12.0, CFG)
    assert tr.tokens_per_s == 100.0 and tr.requests_per_s == 2.0 and tr.ttft_s == 0.5
    assert tr.last_inference_at == 12.0 and list(tr.history) == [0.0, 100.0]
    tr.observe(Probe(ok=True, generation_tokens_total=5, requests_ok_total=1), 14.0, CFG)  # restarted
    assert tr.last_tokens == 5 and tr.last_inference_at == 12.0


def test_hardware_validation() -> None:
    doc = {"accelerator_type": "nvidia_h100", "driver_version": "535.129.03", "device_count": 8}
    assert validate_hardware("nvidia_h100", doc).ok
    check = validate_hardware("nvidia_h100", {**doc, "driver_version": "520.61.05"})
    assert not check.ok and check.reason == ("driver 520.61.05 is older than the minimum 525.85 (CUDA 12.0+) "
                                             "for nvidia_h100")
    check = validate_hardware("amd_mi300x", {**doc, "accelerator_type": "nvidia_a100"})
    assert not check.ok and "declared amd_mi300x" in check.reason and "reports nvidia_a100" in check.reason
    assert validate_hardware("amd_mi300x", {"accelerator_type": "amd_mi300x", "driver_version": "5.7.1"}).ok is False
    assert not validate_hardware("nvidia_h100", {**doc, "device_count": 0}).ok
    lenient = validate_hardware("nvidia_h100", None)
    assert lenient.ok and lenient.note == NO_PROBE_NOTE
    strict = validate_hardware("nvidia_h100", None, strict=True, probe_url="http://n:1/zml/v1/node")
    assert not strict.ok and "http://n:1/zml/v1/node" in strict.reason
    assert validate_hardware("nvidia_h100", {**doc, "driver_version": ""}).note.startswith("driver version unknown")
    assert not validate_hardware("nvidia_h100", {**doc, "driver_version": ""}, strict=True).ok
