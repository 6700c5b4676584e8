"""The accelerator types ZML knows (the API reference's table) and their default profiles.

A *type ID* (``nvidia_h100``) is what a node declares in zml.toml; a *family* (``H100``) is
what policies chain over. A node may declare its own family (``H100_PCIe``) to split a type.

The performance defaults are the fleet model of ``shared/reference/routing-frontier.md``:
prefill 10,000 tok/s x speed, decode 60 tok/s x speed per sequence slowed by 2% per extra
sequence in the batch, 32 or 16 concurrent sequences, $/GPU-hour list prices. Every number is
overridable per node in zml.toml (``[nodes.sim]``) and at run time on a sim node.
"""

from __future__ import annotations

import msgspec


class AcceleratorType(msgspec.Struct, frozen=True, kw_only=True):
    type_id: str
    family: str
    hardware: str
    vendor: str
    #: Minimum driver / runtime version, compared numerically component by component.
    min_driver: str
    driver_label: str
    # --- default performance model (see module docstring) ---
    speed: float
    max_concurrency: int
    cost_per_hour: float
    memory_gib: float
    #: Seconds to load an 8B fp16 model from local disk. MI300X is 50% slower than H100
    #: (the API reference: 40-60% longer cold start at comparable precision).
    load_time_s: float
    #: Tokens per KV-cache block of the engine usually run on it (vLLM's ``CacheConfig``
    #: default of 16 on CUDA and ROCm; the Gaudi plugin 128; 128 for Neuron and CPU engines). A
    #: prefix is cached whole blocks at a time, so it sets how much of a shared prefix a node
    #: can reuse. Health reads the real value (``vllm:cache_config_info``, llama.cpp's 1) where
    #: the engine reports it; this is the default of the simulated nodes and of the router's
    #: prefix index for a node that reports none (zmlcore.policy.prefix.kv_geometry).
    kv_block_size: int = 16
    #: Prompt tokens its engine's KV cache holds by default: an 8B fp16 model (128 KiB of KV
    #: per token) in 90% of the device memory minus 16 GB of weights; on CPU, llama.cpp's
    #: 32k context. Like the block size, a default for nodes whose engine reports no geometry.
    kv_cache_tokens: int
    #: The type's own speeds where ``speed`` x the H100 figures do not fit its engine (a CPU
    #: runs llama.cpp, whose prefill/decode ratio is nothing like a GPU's); 0: speed x base.
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    #: Per-sequence decode slowdown per extra sequence in the batch (0: the GPU figure,
    #: DECODE_BATCH_PENALTY): on a CPU the batch shares the same cores.
    batch_penalty: float = 0.0
    #: How far its real speeds may be from these, as a standard deviation of log(speed): the
    #: learner's prior (zmlcore.fleet.learn). A GPU type's speeds are within ~2x for the
    #: reference 8B model; "cpu" covers a 100M-parameter toy and an 8B model alike.
    prior_sigma: float = 0.7

    @property
    def default_prefill_tps(self) -> float:
        return self.prefill_tps or BASE_PREFILL_TPS * self.speed

    @property
    def default_decode_tps(self) -> float:
        return self.decode_tps or BASE_DECODE_TPS * self.speed

    @property
    def default_batch_penalty(self) -> float:
        return self.batch_penalty or DECODE_BATCH_PENALTY


BASE_PREFILL_TPS = 10_000.0
BASE_DECODE_TPS = 60.0
DECODE_BATCH_PENALTY = 0.02

ACCELERATORS: dict[str, AcceleratorType] = {
    a.type_id: a
    for a in (
        AcceleratorType(
            type_id="nvidia_h100", family="H100", hardware="NVIDIA H100 SXM / PCIe", vendor="nvidia",
            min_driver="525.85", driver_label="CUDA 12.0+", speed=1.0, max_concurrency=32,
            cost_per_hour=4.0, memory_gib=80.0, load_time_s=20.0, kv_block_size=16, kv_cache_tokens=458_000,
        ),
        AcceleratorType(
            type_id="nvidia_a100", family="A100", hardware="NVIDIA A100 SXM / PCIe", vendor="nvidia",
            min_driver="515.48", driver_label="CUDA 11.7+", speed=0.55, max_concurrency=16,
            cost_per_hour=2.0, memory_gib=80.0, load_time_s=24.0, kv_block_size=16, kv_cache_tokens=458_000,
        ),
        AcceleratorType(
            type_id="amd_mi300x", family="MI300X", hardware="AMD Instinct MI300X", vendor="amd",
            min_driver="6.0", driver_label="ROCm 6.0", speed=0.9, max_concurrency=32,
            cost_per_hour=3.0, memory_gib=192.0, load_time_s=30.0, kv_block_size=16, kv_cache_tokens=1_280_000,
        ),
        AcceleratorType(
            type_id="intel_gaudi2", family="Gaudi2", hardware="Intel Gaudi2", vendor="intel",
            min_driver="1.12", driver_label="Habana Labs driver 1.12", speed=0.5, max_concurrency=16,
            cost_per_hour=1.5, memory_gib=96.0, load_time_s=26.0, kv_block_size=128, kv_cache_tokens=577_000,
        ),
        AcceleratorType(
            type_id="aws_inferentia2", family="Inferentia2", hardware="AWS Inferentia2", vendor="aws",
            min_driver="2.18", driver_label="Neuron SDK 2.18", speed=0.3, max_concurrency=16,
            cost_per_hour=0.8, memory_gib=32.0, load_time_s=40.0, kv_block_size=128, kv_cache_tokens=105_000,
        ),
        # llama.cpp (or another CPU engine) on a CPU. What it runs spans 100x: a 100M-parameter
        # model on one thread prefills ~14,000 and decodes ~500 tokens/s, an 8B model at 4 bits
        # on a 16-core server ~150 and ~12. The defaults are the geometric middle (1,500 and 75,
        # within ~10x of either end) with a wide prior (sigma 1.6: 5x at one sigma), so the
        # learner moves to the real speeds in a request or two (docs/routing.md "Learned
        # speeds"); per-sequence decode falls ~2.6x from 1 to 4 sequences on one thread.
        AcceleratorType(
            type_id="cpu", family="CPU", hardware="CPU (llama.cpp and other CPU engines)", vendor="cpu",
            min_driver="0", driver_label="none", speed=0.05, max_concurrency=4,
            cost_per_hour=0.2, memory_gib=64.0, load_time_s=10.0, kv_block_size=128, kv_cache_tokens=32_768,
            prefill_tps=1500.0, decode_tps=75.0, batch_penalty=0.5, prior_sigma=1.6,
        ),
    )
}

#: Spellings accepted for a family in policies (case-insensitive), e.g. the seeds' "Inf2".
FAMILY_ALIASES: dict[str, str] = {
    "h100": "H100",
    "a100": "A100",
    "mi300x": "MI300X",
    "gaudi2": "Gaudi2",
    "inferentia2": "Inferentia2",
    "inf2": "Inferentia2",
    "cpu": "CPU",
}
for _a in ACCELERATORS.values():
    FAMILY_ALIASES[_a.type_id] = _a.family


def canonical_family(name: str) -> str:
    """Canonical spelling of a family name; unknown names are returned unchanged."""
    return FAMILY_ALIASES.get(name.lower(), name)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"525.85.12"`` -> ``(525, 85, 12)``; non-numeric parts are ignored."""
    parts: list[int] = []
    for piece in version.replace("-", ".").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if digits:
            parts.append(int(digits))
    return tuple(parts)


def driver_ok(type_id: str, reported: str) -> bool:
    """True when ``reported`` meets the minimum driver of ``type_id``."""
    return version_tuple(reported) >= version_tuple(ACCELERATORS[type_id].min_driver)
