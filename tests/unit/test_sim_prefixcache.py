"""The simulated node's prefix cache: hits, vLLM's last-token rule, LRU eviction of unpinned
blocks only, and the KV events each change makes."""

from __future__ import annotations

import hashlib
import pickle

from zmlcore.fleet.kvevents.wire import Cleared, Removed, Stored
from zml_sim.prefixcache import NONE_HASH, PrefixCache, block_digests, external, token_ids


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_tokens_are_four_characters_each_and_stable() -> None:
    assert len(token_ids("a" * 17)) == 5
    assert token_ids("hello world!") == token_ids("hello world!")
    assert token_ids("hello world!")[:2] == token_ids("hello wo")  # a prefix keeps its tokens


def test_block_hashes_are_vllms_sha256_chain() -> None:
    # vllm/v1/core/kv_cache_utils.hash_block_tokens with vllm.utils.hashing.sha256 (0.34.0):
    # sha256(pickle((parent, tuple(tokens), extra_keys))), NONE_HASH = sha256(pickle("vllm-none-hash")).
    none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert NONE_HASH == none
    first = hashlib.sha256(pickle.dumps((none, (1, 2), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    second = hashlib.sha256(pickle.dumps((first, (3, 4), None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert block_digests([1, 2, 3, 4, 5], 2) == [first, second]
    assert external(second) == int.from_bytes(second[-8:], "big")


def test_a_repeated_prompt_hits_all_but_the_last_token() -> None:
    c = PrefixCache(block_size=4, capacity=100)
    h1 = c.admit(toks(16))
    assert h1.cached_tokens == 0
    ev = c.take_events()
    assert len(ev) == 1 and isinstance(ev[0], Stored) and len(ev[0].hashes) == 4 and ev[0].parent is None
    assert ev[0].token_ids == toks(16) and ev[0].block_size == 4
    c.release(h1)
    h2 = c.admit(toks(16))
    assert h2.cached_tokens == 12  # 16 tokens: the last must be recomputed, so 3 blocks of 4
    assert c.take_events() == []  # nothing new stored
    assert (c.queries, c.hits) == (32, 12)


def test_a_longer_follow_up_stores_only_its_new_blocks_chained_to_the_hit() -> None:
    c = PrefixCache(block_size=4, capacity=100)
    c.release(c.admit(toks(9)))
    first = c.take_events()[0]
    assert isinstance(first, Stored)
    h = c.admit(toks(21))
    assert h.cached_tokens == 8
    ev = c.take_events()[0]
    assert isinstance(ev, Stored) and ev.parent == first.hashes[-1]
    assert ev.token_ids == toks(21)[8:20] and len(ev.hashes) == 3


def test_lru_eviction_skips_blocks_in_use() -> None:
    c = PrefixCache(block_size=4, capacity=6)
    a = c.admit(toks(12, 0))  # 3 blocks, pinned
    b = c.admit(toks(12, 100))  # 3 blocks, pinned: full
    c.take_events()
    c.release(b)  # b's blocks evictable, a's not
    n = c.admit(toks(8, 200))  # 2 new blocks: evicts b's two oldest
    ev = c.take_events()
    removed = [e for e in ev if isinstance(e, Removed)]
    assert len(removed) == 1 and len(removed[0].hashes) == 2
    b_hashes = [external(d) for d in block_digests(toks(12, 100), 4)]
    assert removed[0].hashes == b_hashes[:2]
    assert all(h in c.lru for h in a.blocks + n.blocks)
    c.release(a), c.release(n)


def test_growing_output_takes_room_from_the_cache() -> None:
    c = PrefixCache(block_size=4, capacity=4)
    c.release(c.admit(toks(16, 0)))  # 4 cached blocks, free
    c.take_events()
    h = c.admit(toks(3, 500))  # no full block; its 3-token tail takes one block
    ev = c.take_events()
    assert [len(e.hashes) for e in ev if isinstance(e, Removed)] == [1]
    c.grow(h, 6)  # 9 tokens: 3 blocks held
    assert len(c.lru) == 1
    c.release(h)


def test_clear() -> None:
    c = PrefixCache(block_size=4, capacity=10)
    c.release(c.admit(toks(8)))
    c.take_events()
    c.clear()
    assert c.take_events() == [Cleared()] and c.blocks == 0
