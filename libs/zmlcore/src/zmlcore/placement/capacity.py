"""The request rate a node can serve for a model within that model's SLO (pure numbers).

Built on the fleet performance model (:mod:`zmlcore.fleet.perfmodel`): prefill one prompt at a
time, decode in a batch whose per-sequence speed falls ~2% per extra sequence. A node's role
for a model comes from these measured numbers, never from its family's name: a node whose
prefill of the model's mean prompt misses the TTFT target serves it at 0 req/s; one whose
per-sequence decode misses the time-per-output-token target at full batch serves it with a
smaller batch.
"""

from __future__ import annotations

import math
from functools import lru_cache

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY


def slo_capacity(*, prefill_tps: float, decode_tps: float, max_concurrency: int, mean_prompt: float,
                 mean_output: float, ttft_s: float | None = None, tpot_s: float | None = None,
                 headroom: float = 0.8, batch_penalty: float = DECODE_BATCH_PENALTY,
                 miss_share: float = 0.0) -> float:
    """Requests/s the node sustains for this request shape within the targets, times ``headroom``
    (queueing keeps a saturated node from meeting a TTFT target; 0.8 leaves a fifth spare).

    With ``miss_share`` > 0 and a TTFT target, also at most the rate at which queueing makes no
    more than that share of requests miss it (:func:`queueing_rate`): a request waits for a free
    sequence slot when all ``max_concurrency`` are decoding (Erlang C), then for the prefills
    queued ahead of it (M/G/1). A node mostly decoding long answers fills its slots long before
    its token throughput saturates, and one mostly prefilling long prompts queues them: either
    misses a TTFT target at a rate ``headroom`` alone says it can serve.

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
    decode_s = max(mean_output - 1.0, 0.0) * step_s
    per_request_s = prefill_s + decode_s / batch
    rate = headroom / per_request_s
    if miss_share > 0 and ttft_s is not None:
        rate = min(rate, queueing_rate(prefill_s, prefill_s + decode_s, batch, ttft_s, miss_share, rate))
    return rate


def queueing_rate(prefill_s: float, hold_s: float, slots: int, ttft_s: float, miss_share: float,
                  upper: float) -> float:
    """The highest rate (at most ``upper``) at which Poisson arrivals miss ``ttft_s`` by queueing
    no more than ``miss_share`` of the time: the chance all ``slots`` are busy (Erlang C, each
    request holding a slot ``hold_s``) plus the chance the prefills queued ahead take longer than
    the target leaves (M/G/1, Kingman's exponential tail with prompts' squared coefficient of
    variation 0.5).

    >>> round(queueing_rate(0.1, 8.6, 32, 2.0, 0.01, 10.0), 2)  # slots bind: 32 x 8.6 s each
    2.34
    >>> round(queueing_rate(0.8, 1.0, 64, 2.0, 0.01, 10.0), 2)   # prefills bind
    0.45
    """
    return _queueing_rate(round(prefill_s, 6), round(hold_s, 6), slots, round(ttft_s, 6), miss_share,
                          round(upper, 9))


@lru_cache(maxsize=65536)
def _queueing_rate(prefill_s: float, hold_s: float, slots: int, ttft_s: float, miss_share: float,
                   upper: float) -> float:
    slack = ttft_s - prefill_s
    if slack <= 0:
        return 0.0

    def miss(lam: float) -> float:
        rho = lam * prefill_s
        if rho >= 1 or lam * hold_s >= slots:
            return 1.0
        tail = rho * math.exp(-2 * (1 - rho) * slack / (rho * prefill_s * 1.5)) if rho > 0 else 0.0
        return _erlang_c(slots, lam * hold_s) + tail

    if miss(upper) <= miss_share:
        return upper
    lo, hi = 0.0, upper
    for _ in range(40):
        mid = (lo + hi) / 2
        if miss(mid) <= miss_share:
            lo = mid
        else:
            hi = mid
    return lo


def _erlang_c(c: int, a: float) -> float:
    """Chance an arrival waits, ``c`` servers, offered load ``a`` Erlangs (< c)."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return c * b / (c - a * (1 - b))
