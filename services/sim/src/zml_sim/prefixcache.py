"""The simulated node's prefix cache: vLLM's automatic prefix caching, block by block. Pure.

* A prompt is tokenized as the sim counts tokens (``estimate_tokens``: one token per 4
  characters); a token's id is a hash of its 4 characters, so equal text gives equal ids.
* Full blocks of ``block_size`` tokens are hashed in a chain exactly as vLLM 0.34 does with its
  default ``prefix_caching_hash_algo = "sha256"`` and no ``PYTHONHASHSEED``:
  ``sha256(pickle((parent, tuple(token_ids), None)))``, the first parent being
  ``sha256(pickle("vllm-none-hash"))``; events carry the low 64 bits, as vLLM sends them.
* A request's cached tokens are its longest run of resident leading blocks, at most
  ``(prompt - 1) // block_size`` of them (vLLM recomputes the last prompt token to get logits).
* The cache holds ``capacity`` blocks (the node's free KV memory over ``block_size``), minus the
  blocks running requests hold beyond their full prompt blocks (partial block, output). Blocks of
  running requests are pinned; the least recently used unpinned block is evicted first.
* Every change is an event (``zmlcore.fleet.kvevents.wire``): ``Stored`` when a request's new full
  prompt blocks are cached (at admission, as vLLM caches at scheduling), ``Removed`` on
  eviction, ``Cleared`` when the cache is reset. Output tokens are not cached (a follow-up turn
  sends them back re-tokenized, which rarely matches the generated ids; see docs/sim.md).
"""

from __future__ import annotations

import hashlib
import pickle
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from zmlcore.fleet.kvevents.wire import Cleared, Event, Removed, Stored

CHARS_PER_TOKEN = 4
VOCAB_SIZE = 128_256  # Llama 3's
_MASK64 = (1 << 64) - 1
NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def token_ids(text: str) -> list[int]:
    """The sim's tokens of ``text``: one per 4 characters (at least one)."""
    if not text:
        return [0]
    return [zlib.crc32(text[i:i + CHARS_PER_TOKEN].encode()) % VOCAB_SIZE
            for i in range(0, len(text), CHARS_PER_TOKEN)]


def root_digest(model: str | None) -> bytes:
    """The chain's first parent: vLLM's NONE_HASH for a node's first model; other models of a
    multi-model sim node start from their own seed (a real vLLM serves one model)."""
    if model is None:
        return NONE_HASH
    return hashlib.sha256(pickle.dumps(("vllm-none-hash", model), protocol=pickle.HIGHEST_PROTOCOL)).digest()


def block_digests(tokens: list[int], block_size: int, root: bytes = NONE_HASH) -> list[bytes]:
    """vLLM's sha256 chain over the full blocks of ``tokens``."""
    out: list[bytes] = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[start:start + block_size]), None),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def external(digest: bytes) -> int:
    """The 64-bit int a vLLM event carries for a block digest."""
    return int.from_bytes(digest, "big") & _MASK64


@dataclass(slots=True)
class Holding:
    """What one admitted request holds in the cache."""

    blocks: list[int]
    #: Prompt tokens found cached at admission.
    cached_tokens: int
    #: Tokens it holds beyond its full prompt blocks (the prompt's tail; output as it grows).
    tail_tokens: int
    #: The cache it holds them in.
    cache: PrefixCache | None = None


@dataclass(slots=True)
class PrefixCache:
    block_size: int
    capacity: int
    #: block hash (64-bit) -> None, least recently used first
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pins: dict[int, int] = field(default_factory=dict)
    #: events since the last :meth:`take_events`
    events: list[Event] = field(default_factory=list)
    #: vLLM's counters, in tokens
    queries: int = 0
    hits: int = 0
    held_tail_blocks: int = 0

    def lookup(self, hashes: list[int], prompt_tokens: int) -> int:
        """Leading resident blocks of a prompt (no side effect)."""
        limit = min(len(hashes), max(0, (prompt_tokens - 1) // self.block_size))
        n = 0
        while n < limit and hashes[n] in self.lru:
            n += 1
        return n

    def admit(self, tokens: list[int], root: bytes = NONE_HASH) -> Holding:
        """Cache a request's prompt at admission: count the query, pin its hits, store and pin its
        new full blocks, evict to make room. Returns what it holds (release it when it ends)."""
        bs = self.block_size
        digests = block_digests(tokens, bs, root)
        hashes = [external(d) for d in digests]
        hit = self.lookup(hashes, len(tokens))
        self.queries += len(tokens)
        self.hits += hit * bs
        for h in hashes[:hit]:
            self.lru.move_to_end(h)
        new = False
        for h in hashes[hit:]:
            if h in self.lru:  # cached past an evicted block
                self.lru.move_to_end(h)
            else:
                self.lru[h] = None
                new = True
        for h in hashes:
            self.pins[h] = self.pins.get(h, 0) + 1
        if new:
            self.events.append(Stored(hashes=hashes[hit:], parent=hashes[hit - 1] if hit else None,
                                      token_ids=tokens[hit * bs:len(hashes) * bs], block_size=bs, medium="GPU"))
        tail = len(tokens) - len(hashes) * bs
        holding = Holding(blocks=hashes, cached_tokens=hit * bs, tail_tokens=tail, cache=self)
        self.held_tail_blocks += -(-tail // bs)
        self.evict()
        return holding

    def grow(self, holding: Holding, tokens: int) -> None:
        """A request generated ``tokens`` more: its unhashed tail takes more blocks."""
        bs = self.block_size
        before = -(-holding.tail_tokens // bs)
        holding.tail_tokens += tokens
        self.held_tail_blocks += -(-holding.tail_tokens // bs) - before
        self.evict()

    def release(self, holding: Holding) -> None:
        """The request ended: its blocks stay cached, evictable; its tail is freed."""
        for h in holding.blocks:
            n = self.pins.get(h, 0) - 1
            if n > 0:
                self.pins[h] = n
            else:
                self.pins.pop(h, None)
        self.held_tail_blocks -= -(-holding.tail_tokens // self.block_size)
        holding.blocks = []
        holding.tail_tokens = 0
        self.evict()

    def resize(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self.evict()

    def evict(self) -> None:
        excess = len(self.lru) - (self.capacity - self.held_tail_blocks)
        if excess <= 0:
            return
        gone: list[int] = []
        for h in self.lru:  # least recently used first; blocks in use are not evictable
            if h not in self.pins:
                gone.append(h)
                if len(gone) == excess:
                    break
        for h in gone:
            del self.lru[h]
        if gone:
            self.events.append(Removed(hashes=gone, medium="GPU"))

    def clear(self) -> None:
        """Reset (vLLM's ``reset_prefix_cache``, called with no request running)."""
        self.lru.clear()
        self.pins.clear()
        self.held_tail_blocks = 0
        self.events.append(Cleared())

    def take_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    @property
    def blocks(self) -> int:
        return len(self.lru)
