"""Block keys of a prompt, computed once per request without a tokenizer.

A prompt is keyed on its **text**, not on token ids: the router has no tokenizer (a Python
tokenizer costs milliseconds for an 8k-token prompt and needs the model's files), and text keys
are the same for every node whatever its engine and block size, so one chain serves the whole
fleet; each node's share is converted to its own tokens afterwards (see ``index.py``).

The prompt is serialised canonically (chat: each message as role, a 0 byte, its text, a 1 byte;
completions: the prompt's text), in UTF-8, behind the model name and a 0 byte (different
models never share a cache). The bytes are cut into blocks of :data:`BLOCK_BYTES`; only whole blocks are keyed
(engines cache whole blocks too). Keys are spaced geometrically: one per block for the first
:data:`FINE_BLOCKS` blocks (4 KB, ~1k tokens), then four per doubling of the prefix (every 1 KB
up to 8 KB, every 2 KB up to 16 KB...): key ``i`` stands for the prefix ``bytes[0 :
KEY_ENDS[i]]``. A match is known to within a quarter of its length past 4 KB, which never
changes a routing decision (the warm node's saving is the whole prefix), and an 8k-token
prompt has 20 keys instead of 64: the index's upkeep and memory are per key. A follow-up
turn, which repeats the conversation and adds to it, shares every key of the previous turn.

The hash is computed for all blocks at once in numpy, a fixed handful of calls (~8-12 us for an
8k-token prompt; a Python loop of ``zlib.crc32`` or ``xxhash`` over its 64 blocks costs 25-50
us): each block's 64-bit words are dotted with random odd constants (mod 2^64), and key ``i``
is the prefix sum of the digests times random odd per-position constants (mod 2^64). Two prefixes share key ``i`` when their first
``i + 1`` blocks are equal. Distinct prefixes collide with probability ~2^-64 for unrelated
text; the weakest case, two blocks that differ only in the last byte of two 8-byte words, is
~2^-8 over the constants. A collision only mis-estimates one request's cache (nothing is served
from the index), so a faster hash wins over a stronger one here.
"""

from __future__ import annotations

import binascii
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Bytes of prompt text per hashed block: ~128 tokens at ~4 bytes per token (the router's
#: body-size estimate).
BLOCK_BYTES = 512
#: Blocks hashed at most: 512 x 512 bytes, ~64k tokens (the rest of a longer prompt is not
#: keyed: a prefix that long is never worth a finer comparison).
MAX_BLOCKS = 512
#: Every block is a key up to this many; then four keys per doubling.
FINE_BLOCKS = 8


def _key_blocks() -> list[int]:
    ends, b, step = [], 0, 1
    while b + step <= MAX_BLOCKS:
        b += step
        ends.append(b)
        if b >= FINE_BLOCKS * step:  # a doubling done: the step doubles too
            step *= 2
    return ends


#: Blocks covered by key ``i`` (1, 2, ... 8, 10, 12, 14, 16, 20, 24, 28, 32, 40 ...), and bytes.
KEY_BLOCKS: list[int] = _key_blocks()
KEY_ENDS: list[int] = [b * BLOCK_BYTES for b in KEY_BLOCKS]
#: keys of a prompt of ``n`` whole blocks: ``_N_KEYS[n]``; their block indices
_N_KEYS = np.searchsorted(np.array(KEY_BLOCKS), np.arange(MAX_BLOCKS + 1), side="right").tolist()
_SEL = np.array(KEY_BLOCKS, dtype=np.intp) - 1

_WORDS = BLOCK_BYTES // 8
_rng = np.random.default_rng(0x5A4D4C)  # fixed: every router replica must compute the same keys
_C = _rng.integers(0, 2**63, size=_WORDS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_POS = _rng.integers(0, 2**63, size=MAX_BLOCKS, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
_EMPTY: list[int] = []
#: little-endian uint64 x n, by n: the keys of a header (:func:`chain_from_header`)
_PACKED = [struct.Struct(f"<{n}Q") for n in range(len(KEY_BLOCKS) + 1)]
#: a serialised prompt longer than this is not believed from a header (a NATS message is smaller)
_MAX_HEADER_NBYTES = 1 << 30


class KeyChain:
    """The block keys of one prompt: ``keys[i]`` covers its first ``KEY_ENDS[i]`` bytes.

    ``nbytes`` is the serialised prompt's length (the keyed part is ``KEY_ENDS[len(keys) -
    1]``). ``keys`` are plain ints (dict keys in the index).

    >>> kc = prompt_keys("m", prompt="x" * 1500)
    >>> len(kc), kc.nbytes
    (2, 1502)
    """

    __slots__ = ("keys", "nbytes")

    def __init__(self, keys: list[int], nbytes: int) -> None:
        self.keys = keys
        self.nbytes = nbytes

    def __len__(self) -> int:
        return len(self.keys)

    def to_bytes(self) -> bytes:
        """The keys packed as little-endian uint64 (what replicas exchange)."""
        return np.array(self.keys, dtype=np.uint64).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, nbytes: int = 0) -> KeyChain:
        keys = np.frombuffer(data, dtype=np.uint64).tolist()
        return cls(keys, nbytes or (KEY_ENDS[len(keys) - 1] if keys else 0))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyChain) and other.keys == self.keys and other.nbytes == self.nbytes

    def __repr__(self) -> str:
        return f"KeyChain({len(self.keys)} keys, {self.nbytes} bytes)"


def model_seed(model: str) -> int:
    """The chain's seed for a model (crc32 of its name: stable across processes and versions)."""
    return zlib.crc32(model.encode())


def chain_from_bytes(data: bytes, seed: int = 0) -> KeyChain:
    """Keys of already serialised prompt bytes (see the module docstring)."""
    n = min(len(data) // BLOCK_BYTES, MAX_BLOCKS)
    if n == 0:
        return KeyChain(_EMPTY, len(data))
    nk = _N_KEYS[n]
    n = KEY_BLOCKS[nk - 1]  # the blocks past the last key's end are in no key: not hashed
    # uint64 array arithmetic wraps silently (mod 2^64), which is what a hash wants.
    d = np.frombuffer(data, dtype=np.uint64, count=n * _WORDS).reshape(n, _WORDS) @ _C
    if seed:
        d[0] ^= np.uint64(seed)
    d *= _POS[:n]
    return KeyChain(d.cumsum()[_SEL[:nk]].tolist(), len(data))


def serialise(messages: Sequence[Any] | None = None, prompt: str | Sequence[str] | None = None,
              model: str = "") -> bytes:
    """The canonical bytes of a chat (``messages``: objects with ``role`` and ``content``, or
    dicts) or a completions ``prompt`` (a list of prompts is keyed on its first), behind the
    model's name (a 0 byte ends it)."""
    if messages is not None:
        usual = _usual_chat(messages, model)
        if usual is not None:
            return usual
        parts: list[str] = [model, "\x00"] if model else []
        add = parts.append
        for m in messages:  # (the usual dicts took _usual_chat's shorter loop)
            if isinstance(m, dict):
                role, content, name = m.get("role", ""), m.get("content"), m.get("name")
            else:
                role, content, name = m.role, m.content, getattr(m, "name", None)
            add(role if not name else f"{role}:{name}")
            add("\x00")
            add(content if type(content) is str else _text(content))
            add("\x01")
        return "".join(parts).encode("utf-8", "surrogatepass")
    if prompt is None:
        return b""
    if not isinstance(prompt, str):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
    return (f"{model}\x00{prompt}" if model else prompt).encode("utf-8", "surrogatepass")


def _usual_chat(messages: Sequence[Any], model: str) -> bytes | None:
    """:func:`serialise` of what the router decodes: dicts with a role and text content and no
    name (a third fewer operations per message than the general loop, ~1 us at 30 messages);
    None for anything else, which the general loop serialises."""
    parts: list[str] = [model, "\x00"] if model else []
    try:
        for m in messages:
            if type(m) is not dict or "name" in m:
                return None
            parts += (m["role"], "\x00", m["content"], "\x01")
        # (join raises TypeError on content that is not text: parts, None)
        return "".join(parts).encode("utf-8", "surrogatepass")
    except (KeyError, TypeError):
        return None


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out: list[str] = []
    for part in content:  # OpenAI content parts: text, image_url, input_audio...
        if isinstance(part, dict):
            t = part.get("text")
            if isinstance(t, str):
                out.append(t)
            else:
                img = part.get("image_url")
                url = img.get("url") if isinstance(img, dict) else img
                out.append(str(url) if url is not None else repr(sorted(part.items())))
        else:
            out.append(str(part))
    return "\x02".join(out)


def prompt_keys(model: str, messages: Sequence[Any] | None = None,
                prompt: str | Sequence[str] | None = None) -> KeyChain:
    """The key chain of one request: what the router computes once, before choosing a node.

    >>> a = prompt_keys("m", messages=[{"role": "user", "content": "hi " * 400}])
    >>> b = prompt_keys("m", messages=[{"role": "user", "content": "hi " * 400},
    ...                               {"role": "assistant", "content": "ok " * 300}])
    >>> b.keys[:len(a)] == a.keys, len(a) < len(b)
    (True, True)
    """
    return chain_from_bytes(serialise(messages, prompt, model))


def keyed(body_bytes: int, embedding: bool) -> bool:
    """Is a request's prompt keyed at all: not an embedding, and a body of at least one key
    block (a shorter prompt holds none, and a router does not decode it again to find out)."""
    return body_bytes >= BLOCK_BYTES and not embedding


def request_keys(model: str, messages: Any, prompt: Any) -> KeyChain | None:
    """The key chain of a request's decoded ``messages`` (chat) or ``prompt`` (completions);
    None when it has neither in a form that is keyed. The router and a front door call this
    alike, so the chain a front door sends is the one the router would compute."""
    if messages is not None:
        return prompt_keys(model, messages=messages if isinstance(messages, list) else None)
    if isinstance(prompt, (str, list)):
        return prompt_keys(model, prompt=prompt)
    return None


def chain_header(chain: KeyChain, model: str) -> str:
    """The ``Zml-Prefix-Keys`` value of ``chain`` for ``model``: its seed (hex), the serialised
    prompt's length and the keys (little-endian uint64, base64). A front door that decoded the
    prompt anyway sends it, so that a router need not decode it again only to key it.

    >>> kc = prompt_keys("m", prompt="x" * 1500)
    >>> chain_from_header(chain_header(kc, "m"), "m") == kc
    True
    """
    return f"{model_seed(model):08x} {chain.nbytes} {binascii.b2a_base64(chain.to_bytes(), newline=False).decode()}"


def chain_from_header(value: str, model: str) -> KeyChain | None:
    """The chain in a ``Zml-Prefix-Keys`` value, or None when it is malformed, for another
    model's seed, or holds a number of keys its length cannot have (the router then computes
    the chain from the prompt itself)."""
    parts = value.split(" ")
    if len(parts) != 3:
        return None
    seed, size, packed = parts
    try:
        if int(seed, 16) != model_seed(model):
            return None
        nbytes = int(size)
        raw = binascii.a2b_base64(packed, strict_mode=True)
    except (ValueError, binascii.Error):
        return None
    if not 0 <= nbytes <= _MAX_HEADER_NBYTES:
        return None
    n = _N_KEYS[min(nbytes // BLOCK_BYTES, MAX_BLOCKS)]
    if len(raw) != 8 * n:
        return None
    return KeyChain(list(_PACKED[n].unpack(raw)), nbytes)
