"""The request rate a node can serve for a model within that model's SLO (pure numbers).

Built on the fleet performance model (:mod:`zmlcore.fleet.perfmodel`): prefill one prompt at a
time, decode in a batch whose per-sequence speed falls ~2% per extra sequence. A node's role
for a model comes from these measured numbers, never from its family's name: a node whose
prefill of the model's mean prompt misses the TTFT target serves it at 0 req/s; one whose
per-sequence decode misses the time-per-output-token target at full batch serves it with a
smaller batch.
"""

from __future__ import annotations

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY


def slo_capacity(*, prefill_tps: float, decode_tps: float, max_concurrency: int, mean_prompt: float,
                 mean_output: float, ttft_s: float | None = None, tpot_s: float | None = None,
                 headroom: float = 0.8, batch_penalty: float = DECODE_BATCH_PENALTY) -> float:
    """Requests/s the node sustains for this request shape within the targets, times ``headroom``
    (queueing keeps a saturated node from meeting a TTFT target; 0.8 leaves a fifth spare).

    >>> round(slo_capacity(prefill_tps=10000, decode_tps=60, max_concurrency=32,
    ...                    mean_prompt=1000, mean_output=100), 2)
    4.36
    >>> slo_capacity(prefill_tps=500, decode_tps=3, max_concurrency=4, mean_prompt=1000,
    ...              mean_output=100, ttft_s=1.0)
    0.0
    """
    if prefill_tps <= 0 or decode_tps <= 0 or max_concurrency < 1:
        return 0.0
    prefill_s = mean_prompt / prefill_tps
    if ttft_s is not None and prefill_s > ttft_s:
        return 0.0
    batch = max_concurrency
    if tpot_s is not None:
        # largest batch whose step time (1 + p (b - 1)) / decode_tps stays within tpot_s
        while batch >= 1 and (1.0 + batch_penalty * (batch - 1)) / decode_tps > tpot_s:
            batch -= 1
        if batch < 1:
            return 0.0
    step_s = (1.0 + batch_penalty * (batch - 1)) / decode_tps
    per_request_s = prefill_s + max(mean_output - 1.0, 0.0) * step_s / batch
    return headroom / per_request_s
