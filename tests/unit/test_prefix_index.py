"""PrefixIndex: lookups, the per-node LRU and the three fidelities (record, correct, events)."""

from __future__ import annotations

import random

import pytest

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.fleet.perfmodel import SimProfile
from zmlcore.messages import KvAllCleared, KvBlockRemoved, KvBlockStored, KvEventBatch, NodeState
from zmlcore.policy.prefix import BLOCK_BYTES, KeyChain, PrefixIndex, chain_from_bytes, kv_geometry
from zmlcore.policy.prefix.index import EVENTS_STALE_S, _depth
from zmlcore.policy.prefix.keys import KEY_BLOCKS, KEY_ENDS


def chain(n_keys: int, tag: int = 0, shared: int = 0, extra: int = 0) -> KeyChain:
    """A chain of ``n_keys`` keys (+ ``extra`` bytes) whose first ``shared`` keys are common to
    every tag and the rest are the tag's own. Up to 8 keys, a key is one 512-byte block."""
    shared = min(shared, n_keys)
    nb = KEY_BLOCKS[n_keys - 1] if n_keys else 0
    sb = KEY_BLOCKS[shared - 1] if shared else 0
    blocks = [(b"S%05d" % i).ljust(BLOCK_BYTES, b".") for i in range(sb)]
    blocks += [(b"T%05d-%05d" % (tag, i)).ljust(BLOCK_BYTES, b".") for i in range(sb, nb)]
    c = chain_from_bytes(b"".join(blocks) + b"x" * extra)
    assert len(c) == n_keys
    return c


def cut(c: KeyChain, n: int) -> KeyChain:
    """The chain of ``c``'s first ``n`` keys (a shorter prompt it extends)."""
    return KeyChain(c.keys[:n], KEY_ENDS[n - 1])


def test_keys_are_spaced_geometrically() -> None:
    assert KEY_BLOCKS[:20] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert len(chain_from_bytes(b"x" * 32768)) == 20  # an 8k-token prompt: 20 keys


def index(*nodes: tuple[str, str], **kw: object) -> PrefixIndex:
    idx = PrefixIndex(**kw)  # type: ignore[arg-type]
    for nid, t in nodes:
        idx.update_node(NodeState(node_id=nid, accelerator_type=t, family="f", endpoint=""))
    return idx


def test_each_node_gets_its_matched_prefix_in_its_own_blocks() -> None:
    idx = index(("h", "nvidia_h100"), ("g", "intel_gaudi2"))
    # llama.cpp caches token by token: health reports its block as 1 (adapters.llamacpp)
    idx.update_node(NodeState(node_id="c", accelerator_type="cpu", family="f", endpoint="", kv_block_size=1,
                              kv_blocks=32_768))
    conv = chain(13, extra=100)  # 20 blocks (10 KB) + 100 bytes: 2,585 tokens
    idx.record("h", chain(9, shared=9), 1.0)
    idx.record("g", conv, 1.0)
    idx.record("c", conv, 1.0)
    assert chain(9, shared=9).keys != conv.keys[:9]  # (different text, different chain)
    idx.record("h", cut(conv, 9), 1.0)  # a 10-block prefix of it
    m = idx.lookup(conv, 2.0)
    assert m.nodes() == {"h": 9, "g": 13, "c": 13}
    prompt = conv.nbytes // 4
    assert m.tokens("h", prompt) == 1280  # 10 blocks of 128 tokens, a multiple of 16
    assert m.tokens("g", prompt) == 2560  # 20 blocks, 20 of the engine's 128-token blocks
    assert m.tokens("c", prompt) == 2560  # llama.cpp: token by token
    whole = chain(13)  # the prompt is exactly the keyed bytes: never all of it
    idx.record("c", whole, 1.0)
    assert idx.lookup(whole).tokens("c") == 2559
    assert m.tokens("nobody") == 0 and idx.lookup(chain(5, tag=9)).nodes() == {}


def test_bisection_finds_what_a_scan_of_every_node_finds() -> None:
    rng = random.Random(3)
    nodes = [(f"n{i}", rng.choice(["nvidia_h100", "amd_mi300x", "cpu"])) for i in range(70)]
    idx = index(*nodes)
    convs = [chain(rng.randint(1, 24), tag=t, shared=rng.choice((0, 5, 12))) for t in range(40)]
    t = 0.0
    for _ in range(3000):
        c = rng.choice(convs)
        idx.record(rng.choice(nodes)[0], cut(c, rng.randint(1, len(c))), t)
        t += 0.01
    for c in convs:
        got = idx.lookup(c, t).nodes()
        want = {nid: d for nid, _ in nodes if (d := _depth(idx.node(nid).gen, c.keys))}  # type: ignore[union-attr]
        assert got == want


def test_the_lru_evicts_a_chains_tail_before_its_root_and_keeps_what_is_touched() -> None:
    idx = index(("h", "nvidia_h100"))
    idx.set_node("h", block_size=16, capacity_tokens=10 * 128)  # 10 blocks of prompt
    a, b = chain(8, tag=1, shared=4), chain(8, tag=2, shared=4)  # 8 blocks each, 4 shared
    idx.record("h", a, 1.0)
    idx.record("h", b, 2.0)  # 4 new blocks: a's 2 deepest go, its root (shared with b) stays
    assert len(idx) == 10
    assert idx.depth("h", a) == 6 and idx.depth("h", b) == 8
    idx.record("h", a, 3.0)  # a comes back: b's tail goes now
    assert idx.depth("h", a) == 8 and idx.depth("h", b) == 6
    big = chain(13, tag=3)  # 20 blocks: keys stand for 1-4 blocks, capacity counts bytes
    idx.set_node("h", block_size=16, capacity_tokens=19 * 128)
    idx.record("h", big, 4.0)
    assert idx.node("h").size <= 19 * BLOCK_BYTES and idx.depth("h", big) == 12  # type: ignore[union-attr]


def test_every_operation_keeps_each_node_prefix_closed() -> None:
    rng = random.Random(5)
    idx = index(("a", "nvidia_h100"), ("b", "aws_inferentia2"))
    idx.set_node("a", block_size=16, capacity_tokens=100 * 128)
    idx.set_node("b", block_size=128, capacity_tokens=30 * 128)
    convs = [chain(rng.randint(1, 18), tag=t, shared=rng.choice((0, 8))) for t in range(25)]
    t = 0.0
    for step in range(2000):
        c, nid = rng.choice(convs), rng.choice("ab")
        op = rng.random()
        if op < 0.7:
            idx.record(nid, c, t)
        elif op < 0.85:
            idx.correct(nid, c, rng.randint(0, KEY_ENDS[len(c) - 1] // 4), t + rng.uniform(0, 5))
        else:
            idx.apply_events(nid, KvEventBatch(node_id=nid, block_size=16,
                                               events=[KvBlockRemoved(block_hashes=[1] * rng.randint(1, 40))]), t)
        t += rng.uniform(0, 1.0)
        if step % 100 == 0:
            for n in "ab":
                lru = idx.node(n).gen  # type: ignore[union-attr]
                for c2 in convs:
                    d = _depth(lru, c2.keys)
                    assert all(k not in lru for k in c2.keys[d:]), "a key held without its prefix"
            assert sum(len(idx.node(n).gen) for n in "ab") == len(idx)  # type: ignore[union-attr]
            for n in "ab":
                nc = idx.node(n)
                assert nc is not None and nc.size <= nc.cap


def test_entries_expire_and_unrouted_nodes_age_too() -> None:
    idx = index(("a", "nvidia_h100"), ("b", "nvidia_h100"), ttl_s=60.0)
    idx.record("a", chain(10, tag=1), 0.0)
    idx.record("b", chain(10, tag=2), 30.0)
    idx.record("b", chain(10, tag=3), 61.0)  # records sweep other nodes as they go
    idx.record("b", chain(10, tag=3), 62.0)
    assert idx.depth("a", chain(10, tag=1)) == 0
    assert idx.depth("b", chain(10, tag=2)) == 10
    idx.expire(95.0)
    assert idx.depth("b", chain(10, tag=2)) == 0 and idx.depth("b", chain(10, tag=3)) == 10


def test_forgotten_nodes_free_their_slot_and_everything_they_held() -> None:
    idx = index(("a", "nvidia_h100"), ("b", "nvidia_h100"))
    c = chain(20)
    idx.record("a", c, 0.0)
    idx.record("b", c, 0.0)
    idx.forget_node("a")
    assert idx.lookup(c).nodes() == {"b": 20} and len(idx) == 20
    idx.update_node(NodeState(node_id="z", accelerator_type="cpu", family="f", endpoint=""))
    assert idx.node("z").slot == 0  # type: ignore[union-attr]
    assert idx.lookup(c).nodes() == {"b": 20}


def test_the_whole_index_stays_within_max_entries() -> None:
    idx = index(*[(f"n{i}", "amd_mi300x") for i in range(10)], max_entries=500)
    for i in range(10):
        assert idx.node(f"n{i}").cap == 50 * BLOCK_BYTES  # type: ignore[union-attr]
    for t in range(200):
        idx.record(f"n{t % 10}", chain(12, tag=t), float(t))
    assert len(idx) <= 500 and idx.stats()["keys"] <= 500


def test_geometry_comes_from_the_engine_else_the_accelerator() -> None:
    st = NodeState(node_id="n", accelerator_type="intel_gaudi2", family="Gaudi2", endpoint="")
    assert kv_geometry(st) == (128, 577_000)
    st.kv_block_size, st.kv_blocks = 16, 1000
    assert kv_geometry(st) == (16, 16_000)
    idx = PrefixIndex()
    idx.update_node(st)
    assert idx.node("n").cap == 16_000 * 4  # prompt bytes at ~4 a token  # type: ignore[union-attr]


@pytest.mark.parametrize("type_id", sorted(ACCELERATORS))
def test_one_kv_geometry_per_accelerator_for_the_index_and_the_simulated_node(type_id: str) -> None:
    """The router's default for a silent node is the geometry a simulated node of that type runs
    (one table, zmlcore.fleet.accelerators): a sim H100 with 64-token blocks under an index that
    assumed 16 would misjudge every partial prefix."""
    a = ACCELERATORS[type_id]
    st = NodeState(node_id="n", accelerator_type=type_id, family=a.family, endpoint="")
    assert kv_geometry(st) == (a.kv_block_size, a.kv_cache_tokens)
    assert SimProfile.for_type(type_id).kv_block_size == a.kv_block_size


# --- reported ---

def test_a_miss_on_a_confirmed_prefix_drops_what_the_engine_dropped_with_it() -> None:
    idx = index(("h", "nvidia_h100"), ttl_s=1000.0)
    old, conv, fresh = chain(8, tag=1), chain(8, tag=2), chain(8, tag=3)
    idx.record("h", old, 0.0)
    idx.correct("h", old, 0, 5.0, prompt_tokens=1024)  # served: the engine holds it
    idx.record("h", conv, 100.0)
    idx.correct("h", conv, 0, 104.0, prompt_tokens=1024)  # confirmed at 104
    idx.record("h", fresh, 200.0)  # only recorded
    nc = idx.node("h")
    assert nc is not None and nc.touched(conv.keys[0]) == 104.0 and nc.touched(fresh.keys[0]) == -200.0
    idx.record("h", conv, 400.0)  # predicted 8 keys, confirmed 296 s ago
    idx.correct("h", conv, 0, 401.0, prompt_tokens=1024)  # the engine had dropped it
    assert nc.misses == 1 and nc.hits == 0
    assert idx.depth("h", old) == 0  # confirmed before it: an LRU engine dropped it too
    assert idx.depth("h", fresh) == 8  # touched after it: kept
    assert idx.depth("h", conv) == 8 and nc.touched(conv.keys[0]) == 401.0  # the engine holds it again
    idx.record("h", conv, 900.0)
    idx.correct("h", conv, 1008, 901.0, prompt_tokens=1031)
    assert nc.hits == 1 and nc.misses == 1


def test_a_miss_on_a_prefix_only_recorded_is_no_evidence() -> None:
    """The request that brought the prefix may still be queued on the engine."""
    idx = index(("h", "nvidia_h100"))
    other, conv = chain(8, tag=1), chain(8, tag=2)
    idx.record("h", other, 0.0)
    idx.record("h", conv, 10.0)
    idx.record("h", conv, 30.0)  # turn 2 sent before turn 1's report
    idx.correct("h", conv, 0, 31.0)
    nc = idx.node("h")
    assert nc is not None and nc.misses == 0
    assert idx.depth("h", other) == 8


def test_a_report_of_more_than_the_index_knew_is_recorded() -> None:
    idx = index(("h", "nvidia_h100"))
    conv = chain(12)
    idx.correct("h", conv, 600, 5.0)  # e.g. another client's traffic warmed it
    assert idx.depth("h", conv) == 12  # and the engine holds the whole prompt now


# --- precise ---

def test_events_clear_and_evict_in_lockstep_with_the_engine() -> None:
    idx = index(("v", "nvidia_h100"), ttl_s=10.0)
    a, b = chain(8, tag=1), chain(8, tag=2)
    idx.record("v", a, 0.0)
    idx.record("v", b, 1.0)
    stored = KvBlockStored(block_hashes=list(range(80)), parent_block_hash=None, block_size=16)
    idx.apply_events("v", KvEventBatch(node_id="v", events=[stored], block_size=16, seq=1), 2.0)
    nc = idx.node("v")
    assert nc is not None and nc.stored_tokens == 1280 and nc.fidelity(2.0) == "precise"
    # 24 blocks of 16 tokens = 384 tokens = 3 keys' worth: the oldest chain's 3 deepest
    idx.apply_events("v", KvEventBatch(node_id="v", events=[KvBlockRemoved(block_hashes=list(range(24)))]), 3.0)
    assert idx.depth("v", a) == 5 and idx.depth("v", b) == 8
    # another tier's events are not the device cache
    idx.apply_events("v", KvEventBatch(node_id="v", events=[KvBlockRemoved(block_hashes=[1] * 400, medium="CPU")]), 3.5)
    assert idx.depth("v", a) == 5
    # while events flow, the TTL does not apply: the engine says what it evicts
    idx.record("v", chain(3, tag=3), 12.0)
    assert idx.depth("v", b) == 8
    idx.apply_events("v", KvEventBatch(node_id="v", events=[KvAllCleared()]), 13.0)
    assert len(idx) == 0 and nc.stored_tokens == 0
    # the feed goes silent: back to the TTL
    idx.record("v", a, 14.0)
    idx.record("v", chain(2, tag=4), 14.0 + EVENTS_STALE_S + 11.0)
    assert idx.depth("v", a) == 0 and nc.fidelity(60.0) == "approximate"


def test_the_engine_block_size_from_events_converts_matches() -> None:
    idx = index(("v", "nvidia_h100"))
    conv = chain(10, extra=10)  # 12 blocks: 1,536 tokens
    idx.record("v", conv, 0.0)
    idx.apply_events("v", KvEventBatch(node_id="v", events=[], block_size=256), 0.0)
    assert idx.lookup(conv).tokens("v") == 1536 // 256 * 256


def test_the_touch_log_stays_bounded_and_eviction_order_survives_compaction() -> None:
    idx = index(("h", "nvidia_h100"))
    idx.set_node("h", block_size=16, capacity_tokens=16 * 128)  # 16 blocks
    hot, cold = chain(8, tag=1), chain(8, tag=2)
    idx.record("h", cold, 0.0)
    for t in range(1, 2000):  # the same conversation again and again: stale log references
        idx.record("h", hot, t / 10)
        idx.correct("h", hot, 0, t / 10 + 0.05)
    nc = idx.node("h")
    assert nc is not None and nc.log_keys <= 2 * len(nc) + 4096 + 30
    idx.record("h", chain(3, tag=3), 250.0)  # 3 over capacity: the cold chain's tail goes
    assert idx.depth("h", hot) == 8 and idx.depth("h", cold) == 5


def held_bytes(nc) -> int:  # type: ignore[no-untyped-def]
    """The prompt bytes a node's entries stand for, from its keys' positions."""
    return sum(KEY_ENDS[g & 63] - (KEY_ENDS[(g & 63) - 1] if g & 63 else 0) for g in nc.gen.values())


def test_holders_sizes_and_the_log_agree_with_each_nodes_entries_through_every_operation() -> None:
    """The index's redundant views of one state, checked against each other after random
    records, reports (misses included), KV events, expiry, capacity evictions, compactions
    and nodes leaving and joining: a key's holders are exactly the nodes whose entries have
    it, a node's size is what its entries stand for, its log counts its entries' references."""
    rng = random.Random(11)
    names = [f"n{i}" for i in range(40)]  # > 30 holders: masks of several machine words
    idx = index(*[(n, rng.choice(list(ACCELERATORS))) for n in names], ttl_s=50.0)
    for n in names[:6]:  # small nodes: capacity evictions on every few records
        idx.set_node(n, block_size=16, capacity_tokens=rng.randint(20, 60) * 128)
    convs = [chain(rng.randint(1, 20), tag=t, shared=rng.choice((0, 4, 9))) for t in range(60)]
    t = 0.0
    for step in range(3000):
        c, nid = rng.choice(convs), rng.choice(names)
        op = rng.random()
        if idx.node(nid) is None:
            idx.set_node(nid, block_size=16, capacity_tokens=200 * 128)
        elif op < 0.6:
            idx.record(nid, c, t)
        elif op < 0.8:
            idx.correct(nid, c, rng.choice((0, KEY_ENDS[len(c) - 1] // 4)), t + rng.uniform(0, 3))
        elif op < 0.9:
            idx.apply_events(nid, KvEventBatch(node_id=nid, block_size=16,
                                               events=[KvBlockRemoved(block_hashes=[1] * rng.randint(1, 60))]), t)
        elif op < 0.995:
            idx.expire(t)
        else:
            idx.forget_node(nid)
        t += rng.uniform(0, 0.5)
        if step % 150 == 0 or step == 2999:
            nodes = {n: idx.node(n) for n in names if idx.node(n) is not None}
            want: dict[int, set[int]] = {}
            for nc in nodes.values():
                assert nc.size == held_bytes(nc) and nc.size <= nc.cap
                assert nc.log_keys == sum(len(k) for _n, _t, k in nc.log) and 0 <= nc.head <= (
                    len(nc.log[0][2]) if nc.log else 0)
                assert set(nc.times) == {num for num, _t, _k in nc.log}
                assert idx._oldest[nc.slot] == (nc.log[0][1] if nc.log else float("inf"))  # (the sweep reads it)
                for k in nc.gen:
                    want.setdefault(k, set()).add(nc.slot)
            got = {k: ({v} if v >= 0 else {s for s in range(len(names) + 1) if ~v >> s & 1})
                   for k, v in idx._holders.items()}
            assert got == want, step


def test_the_log_is_not_scanned_by_the_garbage_collector() -> None:
    """A million entries must not make every full collection slower (the router collects
    every 10 s): the log's entries are untracked once the collector has seen them."""
    import gc

    idx = index(("a", "nvidia_h100"))
    for t in range(200):
        idx.record("a", chain(12, tag=t), float(t))
    gc.collect()  # (an entry is untracked once its keys are: the first pass may see it first)
    gc.collect()
    nc = idx.node("a")
    assert nc is not None and len(nc.log) == 200
    assert not any(gc.is_tracked(e) for e in nc.log)


def test_tokens_by_slot_follow_block_size_changes() -> None:
    idx = index(("a", "nvidia_h100"), ("b", "intel_gaudi2"))
    sa, sb = idx.node("a").slot, idx.node("b").slot  # type: ignore[union-attr]
    tok, every = idx.tokens_by_slot(1000)
    assert (tok[sa], tok[sb]) == (1000 // 16 * 16, 1000 // idx.node("b").block * idx.node("b").block) and every
    idx.apply_events("b", KvEventBatch(node_id="b", events=[], block_size=256), 0.0)
    tok, every = idx.tokens_by_slot(1000)
    assert tok[sb] == 768 and every
    idx.set_node("a", block_size=2048, capacity_tokens=10**6)
    tok, every = idx.tokens_by_slot(1000)
    assert tok[sa] == 0 and not every
    idx.update_node(NodeState(node_id="c", accelerator_type="nvidia_h100", family="H100", endpoint=""))
    tok, _ = idx.tokens_by_slot(1000)
    assert len(tok) == 3 and tok[idx.node("c").slot] == 992  # type: ignore[union-attr]


def test_re_recording_the_last_touch_is_a_touch_now_recorded_not_confirmed() -> None:
    """A follow-up turn that adds no key re-records the node's last touch (the index only moves
    that touch's time, _touch): to expiry, to a report's miss test and to ``touched`` it is a
    new touch, as a touch of any other chain would be."""
    idx = index(("h", "nvidia_h100"), ttl_s=100.0)
    conv = chain(8, tag=1)
    idx.record("h", conv, 0.0)
    idx.correct("h", conv, 0, 5.0, prompt_tokens=1024)  # confirmed at 5
    nc = idx.node("h")
    assert nc is not None and nc.touched(conv.keys[-1]) == 5.0
    idx.record("h", conv, 50.0)  # the same chain again, nothing in between
    assert nc.touched(conv.keys[0]) == -50.0 and nc.touched(conv.keys[-1]) == -50.0
    assert idx._oldest[nc.slot] == nc.log[0][1]  # (what the sweep of other nodes reads)
    idx.correct("h", conv, 0, 51.0, prompt_tokens=1024)  # a miss on what was confirmed at 5
    assert nc.misses == 1 and idx.depth("h", conv) == 8  # touched at 50: not dropped with it
    assert nc.touched(conv.keys[0]) == 51.0
    idx.expire(140.0)  # 100 s after the first touch, not after the last
    assert idx.depth("h", conv) == 8
    idx.expire(152.0)
    assert idx.depth("h", conv) == 0
