"""Measured node speeds from engine counters (pure: the caller passes each poll's readings).

vLLM reports per-request prefill and decode intervals (``vllm:request_prefill_time_seconds``,
``vllm:request_decode_time_seconds``) beside the tokens they covered
(``vllm:prompt_tokens_total``, ``vllm:request_generation_tokens``). Between two polls:

* prefill tokens/s = Δprompt tokens / Δprefill time;
* decode tokens/s of one sequence = Δ(generated tokens − first tokens) / Δdecode time, measured
  at the batch sizes the node ran; divided back to batch 1 with the fleet model's 2% per extra
  sequence (``zmlcore.fleet.accelerators.DECODE_BATCH_PENALTY``) using the running count.

llama.cpp counts prefill and decode time per slot (``llamacpp:prompt_seconds_total``,
``llamacpp:tokens_predicted_seconds_total``) beside the tokens (``prompt_tokens_total``,
``tokens_predicted_total``; no first token to subtract: ``gen_requests`` is 0), and the batch
size of a window is Δ(busy slots summed over decode steps) / Δ(decode steps), which is better
than the running count sampled at the poll.

Both are smoothed (EWMA) and only updated from windows with enough tokens, so one short request
does not swing them. Routers use them for TTFT estimates instead of the accelerator type's
assumed speeds: a node that is slower than its type (thermal throttling, a bigger model, a bad
driver) is seen as slower.

    >>> m = SpeedMeter()
    >>> m.observe(Readings(0, 0.0, 0, 0, 0.0), running=1)
    >>> m.observe(Readings(10_000, 1.0, 2_010, 10, 40.0), running=1)
    >>> round(m.prefill_tps), round(m.decode_tps)
    (10000, 50)
    >>> m = SpeedMeter()  # llama.cpp: 3 sequences per decode step in the window
    >>> m.observe(Readings(0, 0.0, 0, 0, 0.0, 0, 0), running=0)
    >>> m.observe(Readings(500, 0.5, 1_000, 0, 10.0, 400, 1_200), running=0)
    >>> round(m.prefill_tps), round(m.decode_tps)
    (1000, 104)
"""

from __future__ import annotations

from dataclasses import dataclass

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY

MIN_TOKENS = 64
ALPHA = 0.3


@dataclass(frozen=True, slots=True)
class Readings:
    prompt_tokens: float
    prefill_time: float
    gen_tokens: float  # sum over finished requests
    gen_requests: float  # how many finished requests that sum covers
    decode_time: float
    #: Decode steps and busy slots summed over them (llama.cpp); None: use the running count.
    decode_steps: float | None = None
    busy_slot_steps: float | None = None


@dataclass(slots=True)
class SpeedMeter:
    prefill_tps: float | None = None
    decode_tps: float | None = None
    last: Readings | None = None
    #: The last window's raw speeds at the concurrency they ran (None: the window had too few
    #: tokens): what the learner (zml_health.speedbook) folds, with its own concurrency model.
    window_prefill: float | None = None
    window_decode: float | None = None
    window_batch: float = 1.0

    def observe(self, r: Readings, running: float) -> None:
        prev, self.last = self.last, r
        self.window_prefill = self.window_decode = None
        if prev is None:
            return
        dp, dpt = r.prompt_tokens - prev.prompt_tokens, r.prefill_time - prev.prefill_time
        dd = (r.gen_tokens - r.gen_requests) - (prev.gen_tokens - prev.gen_requests)
        ddt = r.decode_time - prev.decode_time
        if min(dp, dpt, dd, ddt) < 0:  # counters reset: the engine restarted
            return
        if dp >= MIN_TOKENS and dpt > 0:
            self.window_prefill = dp / dpt
            self.prefill_tps = _ewma(self.prefill_tps, dp / dpt)
        if dd >= MIN_TOKENS and ddt > 0:
            batch = float(running)
            if None not in (r.decode_steps, prev.decode_steps, r.busy_slot_steps, prev.busy_slot_steps):
                steps = r.decode_steps - prev.decode_steps  # type: ignore[operator]
                if steps > 0:
                    batch = (r.busy_slot_steps - prev.busy_slot_steps) / steps  # type: ignore[operator]
            self.window_decode, self.window_batch = dd / ddt, max(batch, 1.0)
            batch1 = dd / ddt * (1.0 + DECODE_BATCH_PENALTY * (max(batch, 1.0) - 1))
            self.decode_tps = _ewma(self.decode_tps, batch1)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
