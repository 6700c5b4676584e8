"""``POST /v1/embeddings`` of a simulated node: deterministic vectors in OpenAI's format.

A vector depends only on (model, input): unit length, seeded by a hash of both, so the same
text embeds the same way on every node and run (what a test can check) and different texts
differ. The request is scheduled like a prefill plus one step (an embedding model runs the
prompt and no decode), so it occupies a slot and shows in the node's load like the real thing.

``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32, what the openai
client asks for); ``dimensions`` 1..4096 (default :data:`DEFAULT_DIMENSIONS`).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

from zmlcore.fleet.perfmodel import estimate_tokens

DEFAULT_DIMENSIONS = 384
MAX_DIMENSIONS = 4096
#: OpenAI's limit on inputs per request.
MAX_INPUTS = 2048


class EmbeddingRequestError(ValueError):
    pass


def parse(body: Any) -> tuple[str | None, list[str], int, str, int]:
    """(model, texts, dimensions, encoding_format, prompt_tokens) of a request body."""
    if not isinstance(body, dict):
        raise EmbeddingRequestError("Request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise EmbeddingRequestError("Field 'model' must be a string")
    raw = body.get("input")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise EmbeddingRequestError("Field 'input' is required: a string, list of strings or token ids")
    if len(items) > MAX_INPUTS:
        raise EmbeddingRequestError(f"'input' has {len(items)} items; at most {MAX_INPUTS}")
    texts: list[str] = []
    tokens = 0
    if all(isinstance(i, str) for i in items):
        texts = list(items)
        tokens = sum(estimate_tokens(t) for t in texts)
    elif all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        texts = [" ".join(map(str, items))]
        tokens = len(items)
    elif all(isinstance(i, list) and i and all(isinstance(t, int) and not isinstance(t, bool) for t in i)
             for i in items):
        texts = [" ".join(map(str, i)) for i in items]
        tokens = sum(len(i) for i in items)
    else:
        raise EmbeddingRequestError("'input' must be a string, a list of strings, token ids or lists of token ids")
    dims = body.get("dimensions", DEFAULT_DIMENSIONS)
    if dims is None:
        dims = DEFAULT_DIMENSIONS
    if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= MAX_DIMENSIONS:
        raise EmbeddingRequestError(f"'dimensions' must be an integer 1..{MAX_DIMENSIONS}")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise EmbeddingRequestError("'encoding_format' must be 'float' or 'base64'")
    return model, texts, dims, fmt, max(1, tokens)


def vector(model: str, text: str, dims: int) -> list[float]:
    """The unit vector of ``text`` under ``model`` (deterministic)."""
    out: list[float] = []
    seed = hashlib.blake2b(f"{model}\x00{text}".encode(), digest_size=16).digest()
    block = 0
    while len(out) < dims:
        digest = hashlib.blake2b(seed + block.to_bytes(4, "little"), digest_size=64).digest()
        # 32 signed 16-bit values per block, centred on 0.
        out.extend(v / 32768.0 for v in struct.unpack("<32h", digest))
        block += 1
    del out[dims:]
    norm = math.sqrt(sum(v * v for v in out)) or 1.0
    return [v / norm for v in out]


def encode(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


def response(model: str, texts: list[str], dims: int, fmt: str, prompt_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": encode(vector(model, t, dims), fmt)}
            for i, t in enumerate(texts)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
