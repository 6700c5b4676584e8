"""PrefixIndex: which prefixes each node holds, as one router knows it. Pure: no I/O, time passed in.

Layout (see the package docstring for the API and docs/routing.md for the design):

* ``_holders``: key -> the nodes that hold it. A single holder is stored as its slot number
  (>= 0, the common case and a small int), several as ``~bitmask`` over slots (< 0).
* per node a :class:`NodeCache`: an ``OrderedDict`` key -> last touch time, oldest first
  (``move_to_end`` / ``popitem(last=False)`` are O(1) in C), its capacity in keys, its engine
  block size and its counters. A touch time is stored negative while the entry is only
  *recorded* (a dispatch said the engine will hold it) and positive once *confirmed* (the
  engine reported it holds it, after the request that brought it there).

Invariant: a node holds a *prefix-closed* set of every chain it holds (key ``i`` of a chain
only with keys ``0..i-1``). Every operation keeps it: a touch moves a chain's keys to the end
deepest first and root last, so that eviction from the front takes a chain's tail before its
root; shrinking removes tails. The holder sets along one chain are therefore nested, and a
lookup finds every node's matched depth by bisection: O(log L) dict reads per distinct depth,
whatever the number of nodes (no per-node scan).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat
from typing import Any

import numpy as np

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.messages import NodeState
from zmlcore.messages.kvcache import KvAllCleared, KvBlockRemoved, KvBlockStored, KvEventBatch
from zmlcore.policy.estimate import BODY_BYTES_PER_TOKEN
from zmlcore.policy.prefix.keys import BLOCK_BYTES, KeyChain

#: An entry untouched this long is dropped (seconds): the safety net for what the index cannot
#: see (other clients of the engine, memory taken by decode) on nodes that report nothing.
DEFAULT_TTL_S = 300.0
#: Entries (key, node) the whole index keeps at most: when the nodes' capacities add up to more,
#: every node's share is scaled down alike. ~170 bytes an entry (docs/benchmarks.md): 2 M
#: entries bound the index near 350 MB.
DEFAULT_MAX_ENTRIES = 2_000_000
#: A reported miss on a prefix confirmed less than this long ago is not taken for an eviction
#: (clocks and reports race by milliseconds, not seconds).
MIN_MISS_AGE_S = 1.0
#: Dispatches whose prediction waits for the engine's report, per node (oldest dropped).
MAX_AWAITING = 1024
#: With no event for this long, a node's events are no longer trusted to evict (seconds).
EVENTS_STALE_S = 30.0

#: Default KV geometry by accelerator type when the node reports none: (block size in tokens,
#: cached tokens). Tokens assume an 8B fp16 model (128 KiB of KV per token) in 90% of the
#: device memory minus 16 GB of weights; vLLM's CUDA/ROCm block is 16 tokens, Gaudi's 128,
#: Neuron's 128; llama.cpp caches token by token in a context of 32k.
KV_DEFAULTS: dict[str, tuple[int, int]] = {
    "nvidia_h100": (16, 458_000),
    "nvidia_a100": (16, 458_000),
    "amd_mi300x": (16, 1_280_000),
    "intel_gaudi2": (128, 577_000),
    "aws_inferentia2": (128, 105_000),
    "cpu": (1, 32_768),
}
_UNKNOWN_KV = (16, 100_000)


def kv_geometry(st: NodeState) -> tuple[int, int]:
    """(block size in tokens, cached tokens it can hold) of a node: what health read from the
    engine (``vllm:cache_config_info``: block_size x num_gpu_blocks), else its type's default."""
    bs, cap = KV_DEFAULTS.get(st.accelerator_type, _UNKNOWN_KV)
    if st.kv_block_size > 0:
        bs = st.kv_block_size
    if st.kv_blocks > 0:
        cap = st.kv_blocks * bs
    return bs, cap


class NodeCache:
    """One node's entries and what the index learned about its cache."""

    __slots__ = (
        "node_id", "slot", "lru", "block", "cap_tokens", "cap", "awaiting", "events_at",
        "event_seq", "stored_tokens", "peak_tokens", "evict_debt", "hits", "misses",
    )

    def __init__(self, node_id: str, slot: int, block: int, cap_tokens: int) -> None:
        self.node_id = node_id
        self.slot = slot
        self.lru: OrderedDict[int, float] = OrderedDict()
        #: engine block size (tokens): a match counts whole blocks only
        self.block = max(1, block)
        #: tokens the engine can keep, and that in index keys (the index's scaled share)
        self.cap_tokens = cap_tokens
        self.cap = 0
        #: chain tail -> (keys predicted cached at dispatch, when the engine had confirmed the
        #: deepest of them, or -1 if it was only recorded, the dispatch time)
        self.awaiting: OrderedDict[int, tuple[int, float, float]] = OrderedDict()
        #: last KV event batch (time received, engine sequence number); None: never
        self.events_at: float | None = None
        self.event_seq = -1
        #: engine tokens stored per its events, the most seen, evictions owed to the index (keys)
        self.stored_tokens = 0
        self.peak_tokens = 0
        self.evict_debt = 0.0
        self.hits = 0
        self.misses = 0

    def fidelity(self, now: float) -> str:
        """``precise`` (KV events are flowing), ``reported`` (the engine reports cached tokens),
        else ``approximate`` (learned from routing decisions only)."""
        if self.events_at is not None and now - self.events_at <= EVENTS_STALE_S:
            return "precise"
        return "reported" if self.hits + self.misses else "approximate"


class Match:
    """A lookup's result: per group of nodes, how many keys of the chain they hold.

    ``groups`` is a list of ``(slots, nkeys)``, ``slots`` a bitmask over the index's slots.
    """

    __slots__ = ("index", "chain", "groups")

    def __init__(self, index: PrefixIndex, chain: KeyChain, groups: list[tuple[int, int]]) -> None:
        self.index = index
        self.chain = chain
        self.groups = groups

    def __bool__(self) -> bool:
        return bool(self.groups)

    def keys(self, node_id: str) -> int:
        """Keys of the chain the node holds (0: none)."""
        nc = self.index._nodes.get(node_id)
        if nc is None:
            return 0
        bit = 1 << nc.slot
        for mask, n in self.groups:
            if mask & bit:
                return n
        return 0

    def tokens(self, node_id: str, prompt_tokens: int = 0) -> int:
        """Prompt tokens the node has cached for this request, in whole blocks of its engine."""
        nc = self.index._nodes.get(node_id)
        if nc is None:
            return 0
        return self.index.to_tokens(self.keys(node_id), nc.block, self.chain, prompt_tokens)

    def nodes(self) -> dict[str, int]:
        """node id -> keys held, for every node that holds any."""
        ids = self.index._ids
        out: dict[str, int] = {}
        for mask, n in self.groups:
            for s in slots_of(mask):
                nid = ids[s]
                if nid is not None:
                    out[nid] = n
        return out


class PrefixIndex:
    """The prefixes each node holds, learned three ways (see the package docstring)."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, bytes_per_token: int = BODY_BYTES_PER_TOKEN,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.bytes_per_token = bytes_per_token
        self.max_entries = max_entries
        self._holders: dict[int, int] = {}
        self._nodes: dict[str, NodeCache] = {}
        #: node id by slot (None: free slot)
        self._ids: list[str | None] = []
        self._free: list[int] = []
        #: engine block size by slot (for the vectorised conversion in FleetIndex)
        self.block_by_slot = np.ones(0, dtype=np.int64)
        #: bumped whenever slots are assigned or freed (FleetIndex caches slot -> row maps)
        self.epoch = 0
        self._sweep = 0

    # --- nodes ---
    def set_node(self, node_id: str, *, block_size: int, capacity_tokens: int) -> None:
        """Declare a node or change its engine's KV geometry."""
        nc = self._nodes.get(node_id)
        if nc is None:
            slot = self._free.pop() if self._free else len(self._ids)
            if slot == len(self._ids):
                self._ids.append(node_id)
                self.block_by_slot = np.append(self.block_by_slot, 1)
            else:
                self._ids[slot] = node_id
            nc = self._nodes[node_id] = NodeCache(node_id, slot, block_size, capacity_tokens)
            self.epoch += 1
        nc.block = max(1, block_size)
        nc.cap_tokens = capacity_tokens
        self.block_by_slot[nc.slot] = nc.block
        self._rescale()

    def update_node(self, st: NodeState) -> None:
        """Declare a node from its polled state (cheap when nothing changed)."""
        bs, cap = kv_geometry(st)
        nc = self._nodes.get(st.node_id)
        if nc is None or nc.block != bs or nc.cap_tokens != cap:
            self.set_node(st.node_id, block_size=bs, capacity_tokens=cap)

    def forget_node(self, node_id: str) -> None:
        """Drop a node (left the fleet) and everything it held."""
        nc = self._nodes.pop(node_id, None)
        if nc is None:
            return
        self._drop(nc, len(nc.lru))
        self._ids[nc.slot] = None
        self._free.append(nc.slot)
        self.epoch += 1
        self._rescale()

    def node(self, node_id: str) -> NodeCache | None:
        return self._nodes.get(node_id)

    def _rescale(self) -> None:
        per_key = BLOCK_BYTES / self.bytes_per_token  # tokens per key
        caps = {n: max(1, int(nc.cap_tokens / per_key)) for n, nc in self._nodes.items()}
        total = sum(caps.values())
        scale = min(1.0, self.max_entries / total) if total else 1.0
        for n, nc in self._nodes.items():
            nc.cap = max(1, int(caps[n] * scale))
            if len(nc.lru) > nc.cap:
                self._drop(nc, len(nc.lru) - nc.cap)

    # --- conversions ---
    def to_tokens(self, nkeys: int, block: int, chain: KeyChain, prompt_tokens: int = 0) -> int:
        """Cached tokens for ``nkeys`` matched keys on a node with ``block``-token blocks: the
        matched bytes in tokens, never the whole prompt (the engine computes at least its last
        token), rounded down to whole blocks."""
        if nkeys <= 0:
            return 0
        t = nkeys * BLOCK_BYTES // self.bytes_per_token
        total = max(prompt_tokens, chain.nbytes // self.bytes_per_token)
        if t >= total:
            t = total - 1
        return t // block * block

    def keys_for_tokens(self, tokens: int, chain: KeyChain) -> int:
        """Keys of ``chain`` wholly inside its first ``tokens`` tokens."""
        return min(len(chain.keys), tokens * self.bytes_per_token // BLOCK_BYTES)

    # --- lookup ---
    def lookup(self, chain: KeyChain, now: float = 0.0) -> Match:
        """Every node's matched prefix of ``chain``: O(log L) dict reads per distinct depth."""
        keys = chain.keys
        g = self._holders
        if not keys:
            return Match(self, chain, [])
        v = g.get(keys[0])
        if v is None:
            return Match(self, chain, [])
        m0 = (1 << v) if v >= 0 else ~v
        groups: list[tuple[int, int]] = []
        last = len(keys) - 1
        v = g.get(keys[last])
        if v is not None:
            top = m0 & ((1 << v) if v >= 0 else ~v)
            if top:
                groups.append((top, last + 1))
                m0 &= ~top
                if not m0:
                    return Match(self, chain, groups)
            last -= 1
        # Each stack entry: nodes ``m`` whose deepest held key is in ``[lo, hi]``.
        stack = [(0, last, m0)]
        while stack:
            lo, hi, m = stack.pop()
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                v = g.get(keys[mid])
                up = m & ((1 << v) if v >= 0 else ~v) if v is not None else 0
                if up == m:
                    lo = mid
                elif not up:
                    hi = mid - 1
                else:
                    stack.append((mid, hi, up))
                    m &= ~up
                    hi = mid - 1
            groups.append((m, lo + 1))
        return Match(self, chain, groups)

    def depth(self, node_id: str, chain: KeyChain) -> int:
        """Keys of ``chain`` the node holds (bisection on its own entries)."""
        nc = self._nodes.get(node_id)
        return 0 if nc is None else _depth(nc.lru, chain.keys)

    # --- approximate: learned from the routers' decisions ---
    def record(self, node_id: str, chain: KeyChain, now: float) -> None:
        """The request of ``chain`` was sent to ``node_id``: the node will hold its prefix.

        Called by the replica that dispatched it and, shared over NATS, by every other replica.
        """
        nc = self._nodes.get(node_id)
        keys = chain.keys
        if nc is None or not keys:
            return
        lru = nc.lru
        d = _depth(lru, keys)
        if d:
            # remember what was predicted, for the engine's report (correct)
            t = lru[keys[d - 1]]
            aw = nc.awaiting
            aw[keys[-1]] = (d, t if t > 0 else -1.0, now)
            if len(aw) > MAX_AWAITING:
                aw.popitem(last=False)
        # recorded, not confirmed: the engine holds it once this request's prefill is done
        self._touch(nc, keys, d, -now)
        over = len(lru) - nc.cap
        if over > 0:
            self._drop(nc, over)
        self._expire(nc, now)
        self._sweep_one(now)

    def _touch(self, nc: NodeCache, keys: list[int], d: int, t: float) -> None:
        """Make ``keys`` (of which the node holds the first ``d``) the most recent, at time
        ``t``, deepest first: the front of the LRU (evicted first) gets a chain's tail first."""
        lru = nc.lru
        new = keys[d:]
        if new:
            lru.update(zip(reversed(new), repeat(t)))
            self._add_holder(new, nc.slot)
        if d:
            old = keys[:d]
            move = lru.move_to_end
            for k in reversed(old):
                move(k)
            lru.update(zip(old, repeat(t)))

    def _add_holder(self, new: list[int], slot: int) -> None:
        g = self._holders
        if not any(map(g.__contains__, new)):
            g.update(zip(new, repeat(slot)))
            return
        bit = 1 << slot
        for k in new:
            v = g.get(k)
            if v is None:
                g[k] = slot
            elif v >= 0:
                if v != slot:
                    g[k] = ~((1 << v) | bit)
            else:
                g[k] = ~(~v | bit)

    def _drop(self, nc: NodeCache, n: int) -> None:
        """Evict the node's ``n`` oldest entries."""
        lru, g, slot = nc.lru, self._holders, nc.slot
        pop = lru.popitem
        for _ in range(min(n, len(lru))):
            k, _t = pop(last=False)
            v = g.get(k)
            if v is None:
                continue
            if v >= 0:
                if v == slot:
                    del g[k]
                continue
            m = ~v & ~(1 << slot)
            if m & (m - 1):
                g[k] = ~m
            elif m:
                g[k] = m.bit_length() - 1
            else:
                del g[k]

    def _remove_keys(self, nc: NodeCache, keys: list[int]) -> None:
        """Drop these keys from the node (a chain's tail)."""
        lru = nc.lru
        held = [k for k in keys if k in lru]
        for k in held:
            lru.move_to_end(k, last=False)
        self._drop(nc, len(held))

    def _expire(self, nc: NodeCache, now: float) -> None:
        if nc.events_at is not None and now - nc.events_at <= EVENTS_STALE_S:
            return  # evictions come from the engine itself
        self._drop_older(nc, now - self.ttl_s)

    def _drop_older(self, nc: NodeCache, limit: float) -> None:
        """Drop the node's entries last touched before ``limit``."""
        n = 0
        for t in nc.lru.values():
            if (t if t > 0 else -t) > limit:
                break
            n += 1
        if n:
            self._drop(nc, n)

    def _sweep_one(self, now: float) -> None:
        """Expire another node's old entries now and then (nodes nobody sends to age too)."""
        ids = self._ids
        if not ids:
            return
        self._sweep = (self._sweep + 1) % len(ids)
        nid = ids[self._sweep]
        if nid is not None:
            self._expire(self._nodes[nid], now)

    def expire(self, now: float) -> None:
        """Expire every node's old entries (O(expired)); ``record`` does it as it goes."""
        for nc in self._nodes.values():
            self._expire(nc, now)

    # --- reported: what the engine says it had cached ---
    def correct(self, node_id: str, chain: KeyChain, cached_tokens: int, now: float,
                prompt_tokens: int = 0) -> None:
        """The engine reported ``cached_tokens`` of this request's ``prompt_tokens`` were cached
        (``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``), at
        the end of the request.

        The engine holds the whole prompt now: its keys are *confirmed* (and recorded if the
        index had lost them). Against what the index predicted at dispatch (kept by
        ``record``): a miss (clearly fewer tokens than predicted) on a prefix the engine had
        *confirmed* at least :data:`MIN_MISS_AGE_S` before is an eviction, and an LRU engine
        that evicted a prefix untouched for ``a`` seconds has evicted everything untouched
        longer: the node's entries older than ``a`` are dropped. A miss on a prefix only
        recorded is not evidence (the request that brought it may still have been in the
        engine's queue). ``prompt_tokens`` (the engine's count) converts tokens to the chain's
        bytes exactly; without it the index's bytes-per-token estimate is used.
        """
        nc = self._nodes.get(node_id)
        keys = chain.keys
        if nc is None or not keys:
            return
        if prompt_tokens > 0 and chain.nbytes > 0:
            got = min(len(keys), cached_tokens * chain.nbytes // prompt_tokens // BLOCK_BYTES)
        else:
            got = self.keys_for_tokens(cached_tokens, chain)
        pred = nc.awaiting.pop(keys[-1], None)
        self._touch(nc, keys, _depth(nc.lru, keys), now)
        if pred is None:
            return
        want, confirmed, sent = pred
        if got >= want - max(1, want // 8):  # (block rounding, the bytes-per-token estimate)
            nc.hits += 1
        elif confirmed > 0 and sent - confirmed >= MIN_MISS_AGE_S:
            nc.misses += 1
            self._drop_older(nc, confirmed)

    # --- precise: the engine's KV events ---
    def apply_events(self, node_id: str, batch: KvEventBatch, now: float) -> None:
        """Apply a batch of the node's KV events (vLLM ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``, bridged into NATS as :class:`~zmlcore.messages.KvEventBatch`).

        The engine speaks token blocks, the index text keys, so events are applied in lockstep
        rather than key by key: a clear empties the node; a removal of ``n`` blocks of ``b``
        tokens evicts that many tokens' worth of the node's oldest entries (the engine evicts its
        least recently used blocks too, tails first, as the index does); stores count the
        engine's occupancy, whose peak when evictions start is the node's real capacity. While
        events flow the index's own capacity and TTL eviction are off for the node: the
        engine's evictions replace them. Only the device tier (``medium`` GPU or unset) counts.
        """
        nc = self._nodes.get(node_id)
        if nc is None:
            return
        if batch.block_size > 0 and batch.block_size != nc.block:
            nc.block = batch.block_size
            self.block_by_slot[nc.slot] = nc.block
        nc.events_at = now
        if batch.seq >= 0:
            nc.event_seq = batch.seq
        per_key = BLOCK_BYTES / self.bytes_per_token
        for ev in batch.events:
            if isinstance(ev, KvAllCleared):
                self._drop(nc, len(nc.lru))
                nc.stored_tokens = 0
                nc.evict_debt = 0.0
                continue
            if ev.medium not in (None, "GPU", "gpu"):
                continue
            bs = ev.block_size if isinstance(ev, KvBlockStored) and ev.block_size > 0 else nc.block
            tokens = len(ev.block_hashes) * bs
            if isinstance(ev, KvBlockStored):
                nc.stored_tokens += tokens
                if nc.stored_tokens > nc.peak_tokens:
                    nc.peak_tokens = nc.stored_tokens
            elif isinstance(ev, KvBlockRemoved):
                nc.stored_tokens = max(0, nc.stored_tokens - tokens)
                nc.evict_debt += tokens / per_key
                n = int(nc.evict_debt)
                if n:
                    nc.evict_debt -= n
                    self._drop(nc, n)

    # --- sizes ---
    def __len__(self) -> int:
        """Entries (key, node) held."""
        return sum(len(nc.lru) for nc in self._nodes.values())

    def stats(self) -> dict[str, Any]:
        return {
            "nodes": len(self._nodes), "entries": len(self), "keys": len(self._holders),
            "max_entries": self.max_entries,
        }


def _depth(lru: OrderedDict[int, float], keys: list[int]) -> int:
    """Leading keys present in a prefix-closed set (bisection)."""
    n = len(keys)
    if not n or keys[0] not in lru:
        return 0
    if keys[-1] in lru:
        return n
    lo, hi = 1, n - 1  # keys[lo-1] held, keys[hi] not
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] in lru:
            lo = mid + 1
        else:
            hi = mid
    return lo


def slots_of(mask: int) -> list[int]:
    """Slot numbers set in ``mask``."""
    if not mask & (mask - 1):
        return [mask.bit_length() - 1] if mask else []
    if mask.bit_count() > 24:
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out

