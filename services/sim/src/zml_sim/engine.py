"""The simulated node's engine: continuous batching in real time, driven by a :class:`SimProfile`.

One scheduler task per node runs the reference fleet model (see ``zmlcore.fleet.perfmodel``):

* requests wait in a FIFO queue; at most ``max_concurrency`` are admitted;
* admitted requests are prefilled one at a time in FIFO order; prefill pauses decode and the
  first token is emitted when a request's prefill ends;
* each decode step emits one token to every decoding sequence and lasts
  ``profile.decode_step_seconds(batch)``;
* with a prefix cache (``zml_sim.prefixcache``), a request's prompt is looked up and cached at
  admission and only its uncached tokens take prefill time; every change to the cache is handed
  to ``on_kv_events`` (the node's KV-event publisher) as one batch per scheduler step.

All durations are divided by ``time_scale`` and multiplied by the ``slowdown`` fault factor.
Steps shorter than ~4 ms of real time are grouped: ``k`` tokens over ``k`` step times, where
``k`` never crosses a sequence's end (so the batch size is constant inside a group) and a new
admission interrupts the group at the next step boundary (so prefill still preempts decode at
step granularity). Sleeps target absolute deadlines, so timer jitter does not accumulate.

Example::

    engine = SimEngine("h100-1", SimProfile.for_type("nvidia_h100"), time_scale=100)
    engine.start()
    engine.load("m")
    await engine.wait_loaded("m")
    req = engine.submit("m", prompt_tokens=1000, max_tokens=50)
    text = await req.text()
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

from zmlcore.fleet.perfmodel import SimProfile
from zmlcore.fleet.kvevents.wire import Event
from zmlcore.bus.cancel import cancel_and_wait
from zml_sim.prefixcache import NONE_HASH, Holding, PrefixCache, block_digests, external, root_digest

#: Weights of one loaded model when no size is given: an 8B model in fp16.
DEFAULT_MODEL_GIB = 16.0
#: KV cache bytes per token of an 8B Llama in fp16 (2 x 32 layers x 8 KV heads x 128 x 2 B).
KV_BYTES_PER_TOKEN = 131_072
GIB = 1024**3
#: Real seconds below which decode steps are grouped.
MIN_STEP_S = 0.004
#: How far the scheduler clock may lag real time before it stops catching up.
MAX_LAG_S = 0.1

OUTPUT_MEDIAN = 200.0
OUTPUT_SIGMA = 0.8
OUTPUT_MAX = 2048

WORDS = (
    "the quick brown fox jumps over a lazy dog while simulated accelerators decode tokens "
    "in continuous batches and the router picks the node with the shortest expected wait"
).split()

# vLLM's bucket boundaries (vllm/engine/metrics.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
GEN_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


#: Words with the separators a real vocabulary has (llama's has U+2028) that JSON carries raw
#: and only a wrong SSE reader splits lines at: LINE SEPARATOR, PARAGRAPH SEPARATOR, NEXT LINE.
SEPARATOR_WORDS = ("line\u2028separator", "paragraph\u2029separator", "next\u0085line")


def token_text(node_id: str, index: int, separators: bool = False) -> str:
    """Text of output token ``index``: the first names the node, then one word per token
    (with ``separators``, every other word is one of :data:`SEPARATOR_WORDS`)."""
    if index == 0:
        return f"[{node_id}] "
    if separators and index % 2:
        return SEPARATOR_WORDS[(index // 2) % len(SEPARATOR_WORDS)] + " "
    return WORDS[(index - 1) % len(WORDS)] + " "


def filler_text(node_id: str, start: int, stop: int, separators: bool = False) -> str:
    return "".join(token_text(node_id, i, separators) for i in range(start, stop))


def generated_tokens(text: str) -> int:
    """How many output tokens ``text`` holds, counted as the sim generates them: each token is
    one word and one space (an assistant prefix the router continues is the sim's own output)."""
    return text.count(" ")


def continued_prompt(prompt: str, separators: bool = False) -> tuple[str, int]:
    """A completions prompt that ends with a run of the sim's own output (``[node] the quick
    ...``, what the router sends to continue a completion: the prompt plus the text so far):
    (the prompt before it, the tokens of that run), else (``prompt``, 0). Like a real model
    continuing text, generation then goes on from that position."""
    end = prompt.rfind("] ")
    start = prompt.rfind("[", 0, end) if end > 0 else -1
    if start < 0:
        return prompt, 0
    run = prompt[start:]
    n = generated_tokens(run)
    if n and run == filler_text(prompt[start + 1:end], 0, n, separators):
        return prompt[:start], n
    return prompt, 0


class SimError(Exception):
    """A refused engine operation (unknown model, not enough memory...)."""


@dataclass
class Faults:
    """Injected faults; every field is settable at start and at run time (``/sim/faults``)."""

    error_rate: float = 0.0
    """Share of requests answered with ``error_status``."""
    error_status: int = 500
    hang: bool = False
    """Accept requests and never answer."""
    drop_mid_stream: float = 0.0
    """Share of requests whose connection is closed after the first token."""
    stall_mid_stream: float = 0.0
    """Share of requests that stop after the first token and send nothing more, the
    connection kept open (a wedged engine)."""
    fail_after_tokens: int = 1
    """drop_mid_stream and stall_mid_stream strike once a request has this many output tokens
    (default: after the first)."""
    slowdown: float = 1.0
    """Factor >= 1 applied to every duration (prefill, decode, load)."""
    crash: bool = False
    """Stop listening, dropping connections."""
    crash_for_s: float | None = None
    """With crash: come back after this many (real) seconds, reloading models."""
    overload: bool = False
    """Answer every request with the engine's overload error."""
    retry_after_s: float | None = None
    """Retry-After header on error and overload answers."""
    overload_delay_s: float = 0.0
    """With overload: the refusal comes after this many (real) seconds, as from an engine that
    held the request in its queue a while before giving up on it (or a loaded host)."""
    probe_loss: float = 0.0
    """Share of ``/health`` requests lost: the connection is closed without an answer."""
    separator_tokens: bool = False
    """Every other output word holds U+2028, U+2029 or U+0085 (sent raw in JSON, as engines do)."""
    refuse_stream_options: bool = False
    """Answer 400 to a request carrying ``stream_options`` (an OpenAI-compatible server that
    does not know the parameter)."""

    def updated(self, data: dict[str, Any]) -> Faults:
        """A copy with ``data`` applied; raises ValueError naming a bad field."""
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for key, value in data.items():
            if key == "crash" and isinstance(value, dict):
                extra = set(value) - {"for_s"}
                if extra:
                    raise ValueError(f"crash: unknown field {sorted(extra)[0]!r}")
                changes["crash"] = True
                changes["crash_for_s"] = _num(value.get("for_s"), "crash.for_s", lo=0.0, optional=True)
                continue
            if key not in known:
                raise ValueError(f"unknown fault {key!r} (one of {', '.join(sorted(known))})")
            if key in ("error_rate", "drop_mid_stream", "stall_mid_stream", "probe_loss"):
                changes[key] = _num(value, key, lo=0.0, hi=1.0)
            elif key == "slowdown":
                changes[key] = _num(value, key, lo=1.0)
            elif key == "overload_delay_s":
                changes[key] = _num(value, key, lo=0.0)
            elif key in ("retry_after_s", "crash_for_s"):
                changes[key] = _num(value, key, lo=0.0, optional=True)
            elif key == "fail_after_tokens":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError("fail_after_tokens: expected an integer >= 1")
                changes[key] = value
            elif key == "error_status":
                if not isinstance(value, int) or isinstance(value, bool) or not 400 <= value <= 599:
                    raise ValueError("error_status: expected an HTTP error status 400..599")
                changes[key] = value
            else:
                if not isinstance(value, bool):
                    raise ValueError(f"{key}: expected true or false")
                changes[key] = value
        if changes.get("crash") is False:
            changes.setdefault("crash_for_s", None)
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: Any, name: str, *, lo: float, hi: float | None = None, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name}: expected a number")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: {value} is out of range ({bound})")
    return float(value)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "sum": self.sum}


@dataclass
class ModelStats:
    prompt_tokens: int = 0
    #: Prompt tokens found in the prefix cache (vLLM's prompt_tokens_cached, llama.cpp's cache_n).
    cached_tokens: int = 0
    #: vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up, and found.
    prefix_queries: int = 0
    prefix_hits: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    failed: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    #: vLLM's request_prefill_time / request_decode_time: own prefill, and first to last token.
    prefill: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    #: vLLM's request_generation_tokens: output tokens of each finished request.
    gen_tokens: Histogram = field(default_factory=lambda: Histogram(GEN_TOKEN_BUCKETS))

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "generation_tokens": self.generation_tokens,
            "success": dict(self.success),
            "failed": self.failed,
            "ttft_seconds": self.ttft.to_dict(),
            "e2e_seconds": self.e2e.to_dict(),
        }


class SimRequest:
    """One request inside the engine. Read its tokens with :meth:`next_chunk` or :meth:`text`."""

    _ids = itertools.count(1)

    def __init__(self, engine: SimEngine, model: str, prompt_tokens: int, output_tokens: int,
                 finish_reason: str, tokens: list[int] | None = None, offset: int = 0,
                 loaded: int = 0) -> None:
        self.id = next(self._ids)
        self.engine = engine
        self.model = model
        self.prompt_tokens = prompt_tokens
        #: The prompt's token ids (None: not cacheable, e.g. an embedding request).
        self.tokens = tokens
        #: Prompt tokens found in the prefix cache at admission.
        self.cached_tokens = 0
        #: Prompt tokens whose KV was pulled from a prefill node (disaggregated decode leg):
        #: they skip prefill and count as cached, as vLLM counts connector-loaded tokens.
        self.loaded = loaded
        self.holding: Holding | None = None
        self.output_tokens = output_tokens
        #: Position of the first output token: a continued answer goes on where its prefix ended.
        self.offset = offset
        self.finish_reason = finish_reason
        self.state = "waiting"  # waiting | prefill | decoding | done | cancelled | failed
        self.generated = 0
        self.arrival = asyncio.get_running_loop().time()
        self.first_token_at: float | None = None
        self.prefill_started_at: float | None = None
        self.finished_at: float | None = None
        self.error: str | None = None
        self._queue: asyncio.Queue[list[str] | None] = asyncio.Queue()
        self._ended = False

    @property
    def remaining(self) -> int:
        return self.output_tokens - self.generated

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    async def next_tokens(self) -> list[str] | None:
        """The text of each token of the engine's next step (or group of steps: one or more
        tokens); None at the end. An engine streams each token as its own event.

        Raises :class:`SimError` if the engine failed the request (crash, unload)."""
        if self._ended:
            return None
        tokens = await self._queue.get()
        if tokens is None:
            self._ended = True
            if self.error is not None:
                raise SimError(self.error)
        return tokens

    async def next_chunk(self) -> str | None:
        """The next text piece the engine emitted (one or more tokens); None at the end."""
        tokens = await self.next_tokens()
        return None if tokens is None else "".join(tokens)

    async def text(self) -> str:
        pieces: list[str] = []
        while (piece := await self.next_chunk()) is not None:
            pieces.append(piece)
        return "".join(pieces)

    def _emit(self, n: int) -> None:
        at, node, sep = self.offset + self.generated, self.engine.node_id, self.engine.faults.separator_tokens
        self._queue.put_nowait([token_text(node, i, sep) for i in range(at, at + n)])
        self.generated += n

    def _close(self, state: str, error: str | None = None) -> None:
        self.state = state
        self.error = error
        self.finished_at = asyncio.get_running_loop().time()
        self._queue.put_nowait(None)


class SimEngine:
    """Continuous-batching scheduler of one simulated node (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        profile: SimProfile,
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        max_waiting: int | None = None,
        faults: Faults | None = None,
        model_sizes: dict[str, float] | None = None,
        prefix_caching: bool = True,
        kv_cache_blocks: int | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.node_id = node_id
        self.profile = profile
        self.time_scale = time_scale
        self.seed = seed
        self.max_waiting = max_waiting
        self.faults = faults or Faults()
        self.model_sizes = dict(model_sizes or {})
        self.models: dict[str, float] = {}  # loaded model -> weights GiB
        self.loading: dict[str, tuple[asyncio.Task[None], float]] = {}  # model -> (task, ready_at)
        self.stats: dict[str, ModelStats] = {}
        self.waiting: deque[SimRequest] = deque()
        self.prefill_queue: deque[SimRequest] = deque()
        self.prefilling: SimRequest | None = None
        self.decoding: list[SimRequest] = []
        self.admitted = 0
        #: llama.cpp's node-wide counters: decode steps, busy slots summed over them, and
        #: decode time summed per slot (real seconds).
        self.decode_steps = 0
        self.busy_slot_steps = 0
        self.decode_slot_seconds = 0.0
        self.model_loaded = asyncio.Event()
        #: Fixed KV-cache size in blocks (None: the free memory's worth, as vLLM sizes it).
        self.kv_cache_blocks = kv_cache_blocks
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(block_size=profile.kv_block_size, capacity=self.cache_capacity_blocks)
            if prefix_caching else None)
        #: Called with each scheduler step's KV events (the node's publisher sets it).
        self.on_kv_events: Callable[[list[Event]], None] | None = None
        self._roots: dict[str, bytes] = {}
        self._length_rng = random.Random(seed)
        self._fault_rng = random.Random(seed * 1_000_003 + 7)
        self._probe_rng = random.Random(seed * 1_000_003 + 11)  # its own: probes do not shift request faults
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ----- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-{self.node_id}")

    async def stop(self) -> None:
        self.reset("engine stopped")
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    def reset(self, reason: str, *, clear_stats: bool = False) -> None:
        """Crash: fail every request, forget loaded and loading models (and, like a restarted
        process, the counters when ``clear_stats``)."""
        for req in [*self.waiting, *self.prefill_queue, *self.decoding,
                    *([self.prefilling] if self.prefilling else [])]:
            if not req.finished:
                self.stats_for(req.model).failed += 1
                req._close("failed", reason)
        self.waiting.clear()
        self.prefill_queue.clear()
        self.decoding.clear()
        self.prefilling = None
        self.admitted = 0
        if self.prefix_cache is not None:  # a crash loses the cache (a restarted engine sends no event)
            self.prefix_cache = PrefixCache(block_size=self.prefix_cache.block_size, capacity=0)
            self._roots.clear()
        for task, _ in self.loading.values():
            task.cancel()
        self.loading.clear()
        self.models.clear()
        self.model_loaded.clear()
        if clear_stats:
            self.stats.clear()
            self.decode_steps = self.busy_slot_steps = 0
            self.decode_slot_seconds = 0.0
        self._wake.set()

    def set_profile(self, profile: SimProfile) -> None:
        """New performance numbers, in effect at once (a larger max_concurrency admits now). A new
        KV block size is a new cache, as an engine restarted with it would have (the old one's
        blocks are cleared: an AllBlocksCleared event)."""
        cache = self.prefix_cache
        self.profile = profile
        if cache is not None and profile.kv_block_size != cache.block_size:
            cache.clear()
            self._flush_kv()
            self.prefix_cache = PrefixCache(block_size=profile.kv_block_size, capacity=self.cache_capacity_blocks)
        self._wake.set()

    # ----- models ------------------------------------------------------------------------------

    def real_seconds(self, model_seconds: float) -> float:
        """Real duration of ``model_seconds`` of simulated work (time_scale, slowdown)."""
        return model_seconds * self.faults.slowdown / self.time_scale

    def model_size(self, model: str) -> float:
        return self.model_sizes.get(model, DEFAULT_MODEL_GIB)

    def load(self, model: str, size_gib: float | None = None) -> bool:
        """Start loading ``model``; False if it is already loaded or loading."""
        if model in self.models or model in self.loading:
            return False
        if size_gib is not None:
            self.model_sizes[model] = size_gib
        pending = sum(self.model_size(m) for m in self.loading)
        if self.weights_gib + pending + self.model_size(model) > self.profile.memory_gib:
            raise SimError(
                f"not enough accelerator memory to load {model!r} "
                f"({self.model_size(model):g} GiB, {self.free_memory_gib - pending:.1f} GiB free)"
            )
        delay = self.real_seconds(self.profile.load_time_s)
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._load(model, delay), name=f"sim-load-{self.node_id}-{model}")
        self.loading[model] = (task, loop.time() + delay)
        return True

    async def _load(self, model: str, delay: float) -> None:
        await asyncio.sleep(delay)
        self.loading.pop(model, None)
        self.models[model] = self.model_size(model)
        self.stats_for(model)
        self.model_loaded.set()

    async def wait_loaded(self, model: str | None = None) -> None:
        """Until ``model`` (default: any model) is loaded; returns at once if nothing loads."""
        if model is None:
            while not self.models and self.loading:
                await asyncio.wait([t for t, _ in self.loading.values()], return_when=asyncio.FIRST_COMPLETED)
            return
        entry = self.loading.get(model)
        if entry is not None:
            await asyncio.wait([entry[0]])  # a cancelled load (crash, unload) just returns

    def unload(self, model: str) -> bool:
        """Unload (or stop loading) ``model``; its in-flight requests fail."""
        if model in self.loading:
            task, _ = self.loading.pop(model)
            task.cancel()
            return True
        if model not in self.models:
            return False
        del self.models[model]
        if not self.models:
            self.model_loaded.clear()
        for req in [*self.waiting, *self.prefill_queue, *self.decoding]:
            if req.model == model:
                self.cancel(req, error=f"model {model!r} was unloaded")
        if self.prefilling is not None and self.prefilling.model == model:
            self.cancel(self.prefilling, error=f"model {model!r} was unloaded")
        if not self.models:
            self.reset_prefix_cache()
        return True

    # ----- prefix cache ------------------------------------------------------------------------

    @property
    def cache_capacity_blocks(self) -> int:
        if self.kv_cache_blocks is not None:
            return self.kv_cache_blocks
        return self.kv_capacity_tokens // self.profile.kv_block_size

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: refused (False) while requests run."""
        cache = self.prefix_cache
        if cache is None:
            return False
        if self.admitted:
            return False
        cache.clear()
        self._flush_kv()
        return True

    def _root(self, model: str) -> bytes:
        root = self._roots.get(model)
        if root is None:  # the first model hashes exactly as vLLM does
            root = self._roots[model] = NONE_HASH if not self._roots else root_digest(model)
        return root

    def cached_prefix(self, model: str, tokens: list[int]) -> int:
        """Prompt tokens of ``tokens`` this node's prefix cache holds now (no side effect)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        hashes = [external(d) for d in block_digests(tokens, cache.block_size, self._root(model))]
        return cache.lookup(hashes, len(tokens)) * cache.block_size

    def _release(self, req: SimRequest) -> None:
        holding, req.holding = req.holding, None
        # (a request admitted before the cache was replaced holds nothing in the new one)
        if holding is not None and self.prefix_cache is not None and holding.cache is self.prefix_cache:
            self.prefix_cache.release(holding)

    def _flush_kv(self) -> None:
        cache = self.prefix_cache
        if cache is not None and cache.events:
            events = cache.take_events()
            if self.on_kv_events is not None:
                self.on_kv_events(events)

    def loading_remaining(self) -> dict[str, float]:
        now = asyncio.get_running_loop().time()
        return {m: max(0.0, ready - now) for m, (_, ready) in self.loading.items()}

    # ----- requests ----------------------------------------------------------------------------

    def output_length(self, max_tokens: int | None) -> tuple[int, str]:
        """(tokens, finish_reason): ``max_tokens`` as if ignore_eos, else a seeded lognormal."""
        if max_tokens is not None:
            return max(1, max_tokens), "length"
        n = round(self._length_rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))
        return min(max(n, 1), OUTPUT_MAX), "stop"

    def sample_error(self) -> bool:
        return self.faults.error_rate > 0 and self._fault_rng.random() < self.faults.error_rate

    def sample_drop(self) -> bool:
        return self.faults.drop_mid_stream > 0 and self._fault_rng.random() < self.faults.drop_mid_stream

    def sample_stall(self) -> bool:
        return self.faults.stall_mid_stream > 0 and self._fault_rng.random() < self.faults.stall_mid_stream

    def sample_probe_loss(self) -> bool:
        return self.faults.probe_loss > 0 and self._probe_rng.random() < self.faults.probe_loss

    @property
    def overloaded(self) -> bool:
        # A new request would have to wait behind more than max_waiting others.
        return self.faults.overload or (
            self.max_waiting is not None
            and self.admitted + len(self.waiting) >= self.profile.max_concurrency + self.max_waiting
        )

    def submit(self, model: str, prompt_tokens: int, max_tokens: int | None = None,
               tokens: list[int] | None = None, offset: int = 0, loaded: int = 0) -> SimRequest:
        """Queue a request; ``tokens`` (the prompt's ids) make it go through the prefix cache;
        ``offset``: output positions already generated (a continued answer goes on from there)."""
        if model not in self.models:
            raise SimError(f"model {model!r} is not loaded")
        output, reason = self.output_length(max_tokens)
        req = SimRequest(self, model, max(1, prompt_tokens), output, reason, tokens, offset, loaded)
        self.waiting.append(req)
        if self.admitted < self.profile.max_concurrency:
            self._wake.set()
        return req

    def cancel(self, req: SimRequest, error: str | None = None) -> None:
        """Take ``req`` out of the queue or batch (client went away); frees its slot."""
        if req.finished:
            return
        if req.state == "waiting":
            self.waiting.remove(req)
        elif req.state == "prefill":
            if req is not self.prefilling:
                self.prefill_queue.remove(req)
            self.admitted -= 1
        elif req.state == "decoding":
            self.decoding.remove(req)
            self.admitted -= 1
        self._release(req)
        self._flush_kv()
        if error is not None:
            self.stats_for(req.model).failed += 1
        req._close("failed" if error else "cancelled", error)
        if self.waiting:
            self._wake.set()

    # ----- observation -------------------------------------------------------------------------

    def stats_for(self, model: str) -> ModelStats:
        stats = self.stats.get(model)
        if stats is None:
            stats = self.stats[model] = ModelStats()
        return stats

    @property
    def running(self) -> int:
        return self.admitted

    def running_for(self, model: str) -> int:
        n = sum(1 for r in self.decoding if r.model == model)
        n += sum(1 for r in self.prefill_queue if r.model == model)
        if self.prefilling is not None and self.prefilling.model == model and not self.prefilling.finished:
            n += 1
        return n

    def waiting_for(self, model: str) -> int:
        return sum(1 for r in self.waiting if r.model == model)

    @property
    def weights_gib(self) -> float:
        return sum(self.models.values())

    @property
    def kv_capacity_tokens(self) -> int:
        return int(max(0.0, self.profile.memory_gib - self.weights_gib) * GIB / KV_BYTES_PER_TOKEN)

    @property
    def kv_used_tokens(self) -> int:
        held = [*self.prefill_queue, *self.decoding]
        if self.prefilling is not None and not self.prefilling.finished:
            held.append(self.prefilling)
        return sum(r.prompt_tokens + r.generated for r in held)

    @property
    def kv_cache_usage(self) -> float:
        cap = self.kv_capacity_tokens
        return min(1.0, self.kv_used_tokens / cap) if cap else 0.0

    @property
    def free_memory_gib(self) -> float:
        kv_gib = self.kv_used_tokens * KV_BYTES_PER_TOKEN / GIB
        return max(0.0, self.profile.memory_gib - self.weights_gib - kv_gib)

    # ----- scheduler ---------------------------------------------------------------------------

    def _admit(self) -> None:
        cache = self.prefix_cache
        while self.waiting and self.admitted < self.profile.max_concurrency:
            req = self.waiting.popleft()
            req.state = "prefill"
            self.admitted += 1
            if cache is not None and req.tokens is not None:
                cache.resize(self.cache_capacity_blocks)
                req.holding = cache.admit(req.tokens, self._root(req.model))
                req.cached_tokens = req.holding.cached_tokens
                stats = self.stats_for(req.model)
                stats.prefix_queries += len(req.tokens)
                stats.prefix_hits += req.cached_tokens
            if req.loaded > req.cached_tokens:
                req.cached_tokens = min(req.loaded, req.prompt_tokens)
            self.prefill_queue.append(req)
        self._flush_kv()

    def _first_token(self, req: SimRequest, now: float) -> None:
        req.first_token_at = now
        stats = self.stats_for(req.model)
        stats.prompt_tokens += req.prompt_tokens
        stats.cached_tokens += req.cached_tokens
        stats.generation_tokens += 1
        stats.ttft.observe(now - req.arrival)
        if req.prefill_started_at is not None:
            stats.prefill.observe(now - req.prefill_started_at)
        req._emit(1)
        if req.remaining <= 0:
            self._finish(req, now)
        else:
            req.state = "decoding"
            self.decoding.append(req)

    def _finish(self, req: SimRequest, now: float) -> None:
        self.admitted -= 1
        self._release(req)
        self._flush_kv()
        stats = self.stats_for(req.model)
        stats.success[req.finish_reason] = stats.success.get(req.finish_reason, 0) + 1
        stats.e2e.observe(now - req.arrival)
        stats.gen_tokens.observe(req.output_tokens)
        if req.first_token_at is not None and req.output_tokens > 1:
            stats.decode.observe(now - req.first_token_at)
        req._close("done")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:
            self._admit()
            if not self.prefill_queue and not self.decoding:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
                continue
            clock = max(clock, loop.time() - MAX_LAG_S)
            if self.prefill_queue:
                req = self.prefill_queue.popleft()
                self.prefilling = req
                req.prefill_started_at = loop.time()
                clock += self.real_seconds(self.profile.prefill_seconds(req.prompt_tokens, req.cached_tokens))
                await asyncio.sleep(max(0.0, clock - loop.time()))
                self.prefilling = None
                if not req.finished:
                    self._first_token(req, loop.time())
                continue
            clock = await self._decode(clock)

    async def _decode(self, clock: float) -> float:
        """One decode step, or a group of steps when steps are shorter than MIN_STEP_S."""
        loop = asyncio.get_running_loop()
        batch = list(self.decoding)
        step = self.real_seconds(self.profile.decode_step_seconds(len(batch)))
        k = 1 if step >= MIN_STEP_S else math.ceil(MIN_STEP_S / step)
        k = max(1, min(k, min(r.remaining for r in batch)))
        start = clock
        end = start + k * step
        self._wake.clear()
        while True:
            timeout = end - loop.time()
            if timeout <= 0:
                break
            if k == 1:
                await asyncio.sleep(timeout)
                break
            # A timer that sets the wake event instead of wait_for, which on Python 3.11 can
            # swallow a cancellation that races with the event (and then stop() would hang).
            timer = loop.call_at(end, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()
            if loop.time() >= end:
                break
            self._wake.clear()
            self._admit()
            if self.prefill_queue:
                # A new admission: stop the group at the next step boundary so prefill can run.
                done = max(1, math.ceil((loop.time() - start) / step - 1e-9))
                if done < k:
                    k = done
                    end = start + k * step
                    await asyncio.sleep(max(0.0, end - loop.time()))
                break
        now = loop.time()
        active = sum(1 for r in batch if not r.finished and r.state == "decoding")
        self.decode_steps += k
        self.busy_slot_steps += k * active
        self.decode_slot_seconds += (end - start) * active
        for req in batch:
            if req.finished or req.state != "decoding":
                continue
            req._emit(k)
            cache = self.prefix_cache
            if cache is not None and req.holding is not None and req.holding.cache is cache:
                cache.grow(req.holding, k)
            self.stats_for(req.model).generation_tokens += k
            if req.remaining <= 0:
                self.decoding.remove(req)
                self._finish(req, now)
        self._flush_kv()
        return end
