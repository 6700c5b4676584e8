"""Learned node speeds on the wire: what a router saw of one attempt (:class:`SpeedSample`, on
``RequestCompleted.speed``), the learner's state (:class:`SpeedFit`, :class:`LearnedSpeeds`:
mergeable and serialisable, ``zmlcore.fleet.learn``) and what the health service publishes per
model in ``NodeState.model_speeds`` (:class:`ModelSpeeds`). docs/routing.md "Learned speeds".
"""

from __future__ import annotations

import msgspec


class SpeedSample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one attempt on a node showed of its speeds (the router fills what it saw).

    >>> SpeedSample(ttft_s=0.2, prefill_tokens=2000, inflight=1, decode_s=1.0, decode_tokens=99)
    SpeedSample(ttft_s=0.2, prefill_tokens=2000, prefill_reported=False, inflight=1, decode_s=1.0, decode_tokens=99, engine_prefill_tps=0.0, engine_decode_tps=0.0, predicted_ttft_s=0.0, alone=False, joined_tokens=0.0, decode_prefill_tokens=0.0, adapter_load_s=None)
    """

    #: Dispatch to first byte of the answer (streamed: the first token), seconds; 0: none seen.
    ttft_s: float = 0.0
    #: Prompt tokens the node had to compute before this request's first token: the uncached
    #: prompt tokens of the requests pending on it at dispatch plus this one's own.
    prefill_tokens: float = 0.0
    #: True when this request's uncached part is the engine's count (usage / timings), False
    #: when it is the router's estimate (body size, prefix index).
    prefill_reported: bool = False
    #: Sequences on the node at dispatch, this one included (every router replica's).
    inflight: int = 1
    #: First to last token, seconds, and the tokens generated after the first.
    decode_s: float = 0.0
    decode_tokens: int = 0
    #: The engine's own per-request speeds where it reports them (llama.cpp ``timings``:
    #: ``prompt_per_second``, ``predicted_per_second``); 0: not reported.
    engine_prefill_tps: float = 0.0
    engine_decode_tps: float = 0.0
    #: The router's TTFT estimate for this node at dispatch (prediction vs observation).
    predicted_ttft_s: float = 0.0
    #: Nothing was pending on the node at dispatch and the router sent it no other prompt
    #: before this one's first token: the prefill timed (TTFT, the engine's prompt timing) was
    #: this request's alone. Otherwise other prompts may have shared its prefill batches
    #: (llama.cpp, vLLM batch the prompts of several slots), and its per-request prompt speed
    #: says only that the node is at least that fast.
    alone: bool = False
    #: Prompt tokens the router sent to the node after this request and before its first token
    #: (they may have shared its prefill batches).
    joined_tokens: float = 0.0
    #: Prompt tokens the router sent to the node between this request's first token and its
    #: last: their prefills paused (or slowed) its decode, which a per-request decode speed
    #: includes.
    decode_prefill_tokens: float = 0.0
    #: The engine loaded the request's adapter before its prefill (vLLM's LoRA resolver,
    #: ``adapters_on_request``): of ``ttft_s``, this much was the load, measured as the first
    #: byte's time less the router's estimate at dispatch (which costs no load), at least 0.
    #: The health service folds it into the node's adapter load time; the learner takes no
    #: prefill speed from such a TTFT. None: nothing was loaded for it.
    adapter_load_s: float | None = None


class SpeedFit(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One speed as a function of concurrency ``c``, in log space:
    ``log rate(c) = a - log(1 + exp(g) * (c - 1))`` (``exp(a)`` tokens/s alone, ``exp(g)`` the
    slowdown per extra sequence), with the 2x2 covariance of (a, g) (a Kalman filter's state)."""

    a: float
    g: float
    paa: float
    pag: float
    pgg: float
    #: Unix time of the last observation folded in (0: the prior only).
    at: float = 0.0
    #: Observations folded in.
    n: int = 0


class LearnedSpeeds(msgspec.Struct, frozen=True, kw_only=True):
    """The learner's state for one (node, model)."""

    prefill: SpeedFit
    decode: SpeedFit
    #: Unix time an engine-side measurement (counters, timings, calibration) last moved it.
    measured_at: float = 0.0
    #: The prior's variance of log speed: what an estimate left alone decays back to.
    prior_var: float = 2.56
    #: Seconds a router waits for a first token beyond the prefill itself (the HTTP exchange,
    #: tokenizing, a slot's setup): its TTFT less the engine's own prompt time, when the prefill
    #: ran alone (an EWMA; 0 until the engine has timed one).
    overhead_s: float = 0.0
    #: Seconds from first token to last of the requests that ran on a full node (every sequence
    #: slot taken at dispatch): an EWMA, 0 until one did. A full node frees a slot every this
    #: over its slots, whatever made its decodes slow (the answers' length, the prefills that
    #: paused them, a shared CPU).
    full_decode_s: float = 0.0


class ModelSpeeds(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A node's speeds for one model as the health service publishes them."""

    #: Prefill tokens/s and per-sequence decode tokens/s with the node otherwise idle.
    prefill_tps: float
    decode_tps: float
    #: Slowdown per extra sequence in flight (rate at c = rate / (1 + slowdown (c - 1))).
    prefill_slowdown: float = 0.0
    decode_slowdown: float = 0.0
    #: Standard deviation of log(speed): 0.22 is "within 25%" at one sigma.
    prefill_sigma: float = 0.0
    decode_sigma: float = 0.0
    #: "measured" (the engine's counters, timings or a calibration request), "learned" (only
    #: from the routers' observations) or "default" (the accelerator/engine prior).
    source: str = "default"
    #: Unix time an observation last moved the estimate (0: never).
    at: float = 0.0
    #: Probability that both speeds are within 25% of the estimate, 0..1.
    confidence: float = 0.0
    samples: int = 0
    #: Seconds of a TTFT that are not prefill (LearnedSpeeds.overhead_s): the routers' TTFT
    #: estimate adds them.
    ttft_overhead_s: float = 0.0
    #: Seconds from first token to last of a request on a full node (LearnedSpeeds.full_decode_s):
    #: the routers' wait for a sequence slot (0: the decode speeds' model instead).
    full_decode_s: float = 0.0


learned_speeds_decoder = msgspec.json.Decoder(LearnedSpeeds)
