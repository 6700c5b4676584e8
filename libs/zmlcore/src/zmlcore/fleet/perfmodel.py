"""Each accelerator type's performance model. Pure numbers: no clocks, no I/O.

The same profile drives ``zml sim`` (in real time), the routing simulator in ``benches/``
(in virtual time) and policy TTFT estimates, so a capacity plan made with one holds for the
others. The model is the reference fleet model (shared/reference/routing-frontier.md):

* prefill runs one request at a time at ``prefill_tps`` tokens/s and pauses decode
  (vLLM V0 without chunked prefill);
* decode advances every admitted sequence by one token per step; a step with ``b`` sequences
  takes ``(1 + 0.02 (b - 1)) / decode_tps`` seconds (continuous batching: per-sequence speed
  falls as the batch grows, total throughput rises);
* at most ``max_concurrency`` sequences are admitted; others wait in a FIFO queue;
* a prompt's tokens found in the node's prefix cache skip prefill: only the *uncached* tokens
  cost time (at least one is computed, for the first token's logits), as in vLLM's automatic
  prefix caching. The cache holds whole blocks of ``kv_block_size`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zmlcore.fleet.accelerators import (
    ACCELERATORS,
    BASE_DECODE_TPS,
    BASE_PREFILL_TPS,
    DECODE_BATCH_PENALTY,
)


@dataclass(frozen=True, slots=True)
class SimProfile:
    accelerator: str
    speed: float
    prefill_tps: float
    decode_tps: float
    max_concurrency: int
    load_time_s: float
    memory_gib: float
    cost_per_hour: float
    batch_penalty: float = DECODE_BATCH_PENALTY
    #: Tokens per KV-cache block (the accelerator type's engine default).
    kv_block_size: int = 16

    @classmethod
    def for_type(cls, type_id: str, **overrides: float | int | None) -> SimProfile:
        """Profile of an accelerator type; ``None`` overrides are ignored.

        >>> SimProfile.for_type("amd_mi300x").max_concurrency
        32
        """
        a = ACCELERATORS[type_id]
        given_speed = overrides.get("speed")
        speed = float(given_speed or a.speed)
        prof = cls(
            accelerator=type_id,
            speed=speed,
            # A speed override scales the H100 figures; the type's own speeds otherwise.
            prefill_tps=BASE_PREFILL_TPS * speed if given_speed else a.default_prefill_tps,
            decode_tps=BASE_DECODE_TPS * speed if given_speed else a.default_decode_tps,
            batch_penalty=a.default_batch_penalty,
            max_concurrency=a.max_concurrency,
            load_time_s=a.load_time_s,
            memory_gib=a.memory_gib,
            cost_per_hour=a.cost_per_hour,
            kv_block_size=a.kv_block_size,
        )
        given = {k: v for k, v in overrides.items() if v is not None and k != "speed"}
        return replace(prof, **given) if given else prof  # type: ignore[arg-type]

    def prefill_seconds(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill time of a prompt whose first ``cached_tokens`` are in the prefix cache."""
        return max(prompt_tokens - cached_tokens, 1) / self.prefill_tps

    def decode_step_seconds(self, batch: int) -> float:
        """Duration of one decode step (one token for each of ``batch`` sequences)."""
        return (1.0 + self.batch_penalty * (max(batch, 1) - 1)) / self.decode_tps

    def decode_rate(self, batch: int) -> float:
        """Tokens/s of one sequence when ``batch`` sequences decode together."""
        return 1.0 / self.decode_step_seconds(batch)

    def capacity_rps(self, mean_prompt: float, mean_output: float) -> float:
        """Saturation throughput with a full batch: 1 / (E[P]/pf + E[O-1]/(maxc r(maxc)))."""
        c = self.max_concurrency
        per_req = mean_prompt / self.prefill_tps + max(mean_output - 1.0, 0.0) / (c * self.decode_rate(c))
        return 1.0 / per_req


def estimate_tokens(text: str) -> int:
    """Token count of text as the sim counts it: one token per 4 characters, at least 1."""
    return max(1, math.ceil(len(text) / 4))
