"""The TTFT estimate (shortest expected TTFT, "STE") and per-node capacity and cost figures.

For a request of ``P`` prompt tokens, ``C`` of them in the node's prefix cache, on a node with
prefill speed ``pf``, decode speed ``r(b)`` per sequence at batch ``b`` and ``maxc`` sequence
slots::

    ttft ~= (pending * E[P] + P - C) / pf  +  max(0, outstanding + 1 - maxc) * E[O-1] / (maxc * r(maxc))

where ``pending * E[P]`` (the prefill queued ahead) becomes the pending requests' own uncached
tokens when the router tracks them (``NodeView.pending_tokens``: with prefix caching a pending
request's prefill is its uncached part, which a mean prompt overstates by several times).

the prefill backlog ahead of the request plus, when every slot is taken, the time for enough
sequences to finish (the node retires ``maxc * r(maxc) / E[O-1]`` sequences a second at full
batch). The model is :class:`zmlcore.fleet.perfmodel.SimProfile` (the reference fleet model); the
estimate splits into a *load key* that depends only on the node's counters and a per-request
``P / pf`` term, which is what lets :class:`~zmlcore.policy.FleetIndex` keep each node's load key
up to date per counter change and score every node for a request in one vector pass.
"""

from __future__ import annotations

import math

from zmlcore.fleet.accelerators import ACCELERATORS, BASE_DECODE_TPS, BASE_PREFILL_TPS, DECODE_BATCH_PENALTY
from zmlcore.messages import NodeState

#: Mean prompt and output lengths (tokens) of the reference workload; used for requests
#: already queued, whose lengths the router does not know.
MEAN_PROMPT_TOKENS = 816.0
MEAN_OUTPUT_TOKENS = 274.0
#: Default latency target when a policy gives none (the reference SLA).
DEFAULT_LATENCY_TARGET_S = 0.5
#: A non-streamed request shows the router no first token, so its ``pending`` ends when this
#: many times its estimated TTFT has passed (or at completion, if sooner) rather than at
#: completion: counted as pending through its decode, it made the node look prefill-bound.
NONSTREAM_PENDING_FOR = 1.0
#: Bytes of request body per prompt token for the router's estimate: ~4 characters of text
#: per token. The envelope is small next to a prompt, and an O(1) length beats a tokenizer.
BODY_BYTES_PER_TOKEN = 4

INF = math.inf


#: Exploration of nodes whose speeds are uncertain (docs/routing.md "Learned speeds"): such a
#: node is scored on an optimistic estimate, its learned speeds times exp(EXPLORE_Z * sigma)
#: (sigma: the health service's standard deviation of log speed), at most EXPLORE_CAP times:
#: "unknown" reads as "possibly fast", so it is sent enough traffic to be measured, but never
#: more than EXPLORE_CAP times its share as estimated, and the optimism shrinks as the samples
#: come in (sigma 0.1 once measured: x1.1). Chosen on the hidden-speed routing simulator
#: (benches/routing_sim.py --hidden): see docs/benchmarks.md.
EXPLORE_Z = 1.0
EXPLORE_CAP = 2.0


def explore_factor(sigma: float) -> float:
    """How much faster than its estimate an uncertain node is scored.

    >>> explore_factor(0.0), explore_factor(0.1) < 1.11, explore_factor(1.6)
    (1.0, True, 2.0)
    """
    return min(EXPLORE_CAP, math.exp(EXPLORE_Z * sigma)) if sigma > 0 else 1.0


def node_speeds(st: NodeState, model: str = "", *, explore: bool = True) -> tuple[float, float, int]:
    """(prefill tok/s, decode tok/s per sequence at batch 1, max concurrency) of a node, as
    routed on: the health service's learned speeds for ``model`` (else the node's), raised
    for exploration in proportion to their uncertainty (:func:`explore_factor`; not with
    ``explore=False``: deadlines and predictions take the estimate as it is).

    Unknown ones (0, a state from no health service) come from the accelerator type's
    profile, and from H100-like defaults for an unknown type.
    """
    a = ACCELERATORS.get(st.accelerator_type)
    ms = st.model_speeds.get(model) if model and st.model_speeds else None
    if ms is not None:
        pf, dec = ms.prefill_tps, ms.decode_tps
        if explore:
            pf *= explore_factor(ms.prefill_sigma)
            dec *= explore_factor(ms.decode_sigma)
    else:
        pf = st.prefill_tps if st.prefill_tps > 0 else (a.default_prefill_tps if a else BASE_PREFILL_TPS)
        dec = st.decode_tps if st.decode_tps > 0 else (a.default_decode_tps if a else BASE_DECODE_TPS)
        if explore and st.prefill_sigma:
            pf *= explore_factor(st.prefill_sigma)
        if explore and st.decode_sigma:
            dec *= explore_factor(st.decode_sigma)
    maxc = st.max_concurrency if st.max_concurrency > 0 else (a.max_concurrency if a else 16)
    return pf, dec, maxc


def node_overhead(st: NodeState, model: str = "") -> float:
    """Seconds of a TTFT on this node that are not prefill (the health service's learned
    ``ttft_overhead_s`` for ``model``; 0 when it has none)."""
    ms = st.model_speeds.get(model) if model and st.model_speeds else None
    return ms.ttft_overhead_s if ms is not None else 0.0


def node_slots(st: NodeState, model: str = "") -> tuple[float, float]:
    """(decode slowdown per extra sequence, seconds a full node's request holds its slot past
    its first token) of a node for ``model``: what its wait for a sequence slot is estimated
    from. The learned slowdown (one CPU thread: ~0.5; a GPU's ~0.02), else the GPU-shaped
    default; the learned decode time on a full node (``ModelSpeeds.full_decode_s``), else 0:
    the speeds' model, a mean answer at the decode speed of a full batch."""
    ms = st.model_speeds.get(model) if model and st.model_speeds else None
    k = (ms.decode_slowdown if ms is not None else st.decode_slowdown) or DECODE_BATCH_PENALTY
    return k, ms.full_decode_s if ms is not None else 0.0


def node_cost(st: NodeState) -> float:
    """$/hour of a node: its state's price. The health service fills it in (zml.toml's price,
    else the type's list price) and ``zml cost set`` overrides it, so 0 is a real price (a
    free node), not "unset"."""
    return st.cost_per_hour


#: Seconds an engine takes to load a LoRA adapter a request names, where the node has measured
#: none (NodeState.adapter_load_s): vLLM's runtime load of a rank-8 to 64 adapter of a 7-8B
#: model from local disk (tens to a few hundred MB read and copied to the device) is well
#: under this; a remote store's download is not counted here (the resolver's cache dir is local).
DEFAULT_ADAPTER_LOAD_S = {"vllm": 1.0}


def adapter_load_s(st: NodeState, adapter: str) -> float | None:
    """Seconds before ``adapter`` runs on this node: 0 where it is loaded, its load time where
    the engine loads it for the request (``adapters_on_request``: vLLM with a LoRA resolver)
    and a slot is free, None where a request for it cannot go (the engine loads no adapter on
    request, or every slot is taken). The node's own measured load time first, else the
    engine's default (:data:`DEFAULT_ADAPTER_LOAD_S`).

    >>> st = NodeState(node_id="v", accelerator_type="nvidia_h100", family="H100", endpoint="",
    ...                backend="vllm", models=["base"], adapters_on_request=True, adapter_slots=2)
    >>> import msgspec
    >>> adapter_load_s(st, "tuned"), adapter_load_s(msgspec.structs.replace(st, adapter_load_s=0.4), "tuned")
    (1.0, 0.4)
    """
    if adapter in st.adapters:
        return 0.0
    if not st.adapters_on_request or (st.adapter_slots and len(st.adapters) >= st.adapter_slots):
        return None
    if st.adapter_load_s > 0:
        return st.adapter_load_s
    return DEFAULT_ADAPTER_LOAD_S.get(st.backend, max(DEFAULT_ADAPTER_LOAD_S.values()))


def fold_adapter_load_s(mean_s: float, s: float) -> float:
    """A node's adapter load time (NodeState.adapter_load_s) with one more load timed: warmup's
    (its own load through the engine's API) or a router's (a request the engine loaded its
    adapter for, SpeedSample.adapter_load_s), one record for both. A moving mean: the first
    load sets it.

    >>> fold_adapter_load_s(0.0, 2.0), round(fold_adapter_load_s(2.0, 1.0), 3)
    (2.0, 1.7)
    """
    return s if mean_s <= 0 else 0.7 * mean_s + 0.3 * s


def prompt_tokens_from_body(nbytes: int) -> int:
    """The router's prompt-length estimate from the size of the request body.

    >>> prompt_tokens_from_body(4000)
    1000
    """
    return nbytes // BODY_BYTES_PER_TOKEN


class Coeffs:
    """Per-node constants of the estimate (recomputed when a node's speeds or price change)."""

    __slots__ = ("pf", "inv_pf", "ep_over_pf", "mean_prompt", "maxc", "c_dec", "mu", "cost", "cost_cap",
                 "overhead", "slowdown")

    def __init__(
        self,
        pf: float,
        dec: float,
        maxc: int,
        cost: float,
        mean_prompt: float = MEAN_PROMPT_TOKENS,
        mean_output: float = MEAN_OUTPUT_TOKENS,
        overhead: float = 0.0,
        slowdown: float = DECODE_BATCH_PENALTY,
        full_decode_s: float = 0.0,
    ) -> None:
        self.pf = pf
        #: seconds of every TTFT that are not prefill (node_overhead)
        self.overhead = overhead
        self.inv_pf = 1.0 / pf
        self.ep_over_pf = mean_prompt / pf
        self.mean_prompt = mean_prompt
        self.maxc = maxc
        #: decode slowdown per extra sequence (node_slots)
        self.slowdown = slowdown
        if full_decode_s > 0:
            # seconds per freed slot at full batch, as measured: a request's decode there over
            # the slots (node_slots)
            self.c_dec = full_decode_s / maxc
        else:
            step_full = (1.0 + slowdown * (maxc - 1)) / dec  # 1 / r(maxc)
            #: seconds per freed slot at full batch: E[O-1] / (maxc * r(maxc))
            self.c_dec = max(mean_output - 1.0, 0.0) * step_full / maxc
        #: saturation throughput, requests/s (SimProfile.capacity_rps)
        self.mu = 1.0 / (self.ep_over_pf + self.c_dec)
        self.cost = cost
        #: $/h per req/s of capacity: what one unit of work costs on this node.
        self.cost_cap = cost / self.mu

    def load_key(self, outstanding: int, pending: int, pending_tokens: float | None = None) -> float:
        """The estimate without the request's own prefill (``ttft = key + (P - C) / pf``):
        the prefill ahead of it (``pending_tokens`` when known, else a mean prompt per pending
        request) and the wait for a sequence slot."""
        q = outstanding + 1 - self.maxc
        ahead = pending * self.ep_over_pf if pending_tokens is None else pending_tokens * self.inv_pf
        return self.overhead + ahead + (q * self.c_dec if q > 0 else 0.0)

    def drain_key(self, outstanding: int) -> float:
        """(outstanding + 1) / capacity: when this node would finish its queue plus one."""
        return (outstanding + 1) / self.mu


def estimate_ttft(
    st: NodeState,
    outstanding: int,
    pending: int,
    prompt_tokens: float,
    *,
    cached_tokens: float = 0.0,
    pending_tokens: float | None = None,
    mean_prompt: float = MEAN_PROMPT_TOKENS,
    mean_output: float = MEAN_OUTPUT_TOKENS,
    model: str = "",
    explore: bool = True,
) -> float:
    """Estimated seconds to first token of a ``prompt_tokens`` request sent to this node now,
    of which the node holds ``cached_tokens`` in its prefix cache: queue wait plus the
    *uncached* tokens at the node's prefill speed.

    >>> st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    >>> round(estimate_ttft(st, outstanding=0, pending=0, prompt_tokens=1000), 3)
    0.1
    >>> round(estimate_ttft(st, outstanding=0, pending=0, prompt_tokens=1000, cached_tokens=800), 3)
    0.02
    """
    c = node_coeffs(st, model, explore=explore, mean_prompt=mean_prompt, mean_output=mean_output)
    return c.load_key(outstanding, pending, pending_tokens) + (prompt_tokens - cached_tokens) * c.inv_pf


def node_coeffs(st: NodeState, model: str = "", *, explore: bool = True, cost: float = 0.0,
                mean_prompt: float = MEAN_PROMPT_TOKENS, mean_output: float = MEAN_OUTPUT_TOKENS) -> Coeffs:
    """A node's estimate coefficients for ``model`` from its state: its speeds (node_speeds),
    TTFT overhead (node_overhead) and slot wait (node_slots)."""
    pf, dec, maxc = node_speeds(st, model, explore=explore)
    k, full = node_slots(st, model)
    return Coeffs(pf, dec, maxc, cost, mean_prompt, mean_output, node_overhead(st, model), k, full)


def nonstream_pending_s(st: NodeState, outstanding: int, pending: int, prompt_tokens: float) -> float:
    """How long the router counts a non-streamed request as ``pending`` (see
    :data:`NONSTREAM_PENDING_FOR`), from the node's counters just before it is dispatched:
    the same estimate the policy chose it by."""
    return NONSTREAM_PENDING_FOR * estimate_ttft(st, outstanding, pending, prompt_tokens)
