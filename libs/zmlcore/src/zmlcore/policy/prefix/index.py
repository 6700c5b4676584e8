"""PrefixIndex: which prefixes each node holds, as one router knows it. Pure: no I/O, time passed in.

Layout (see the package docstring for the API and docs/routing.md for the design):

* ``_holders``: key -> the nodes that hold it. A single holder is stored as its slot number
  (>= 0, the common case and a small int), several as ``~bitmask`` over slots (< 0).
* per node a :class:`NodeCache` (``node.py``): ``gen``, a plain dict key -> the number of the
  touch that last refreshed it and the key's position in its chain (``touch << 6 | position``: a key's
  position gives the bytes it stands for, ``KEY_ENDS``), and ``log``, the touches oldest
  first, each with its keys deepest first.
  Evicting walks the log from its head and drops the keys whose last touch is that one; a
  touch is one C-level ``dict.update`` over the chain, which is what keeps a record of an
  8k-token prompt at a few microseconds (an ``OrderedDict`` moving every key costs ~10x more).
  A touch is *recorded* (a dispatch said the engine will hold its keys) until the engine's
  report *confirms* it (``confirmed``: touch -> time): one dict write per report.

Invariant: a node holds a *prefix-closed* set of every chain it holds (key ``i`` of a chain
only with keys ``0..i-1``). Every operation keeps it: a touch lists a chain deepest first, so
eviction takes a chain's tail before its root; shrinking removes tails. The holder sets along
one chain are therefore nested, and a lookup finds every node's matched depth by bisection:
O(log L) dict reads per distinct depth, whatever the number of nodes (no per-node scan).

Memory: per entry ~one dict slot per node entry and per distinct key, the key's int, and the
log's references (compacted when stale ones outnumber the live ones); ``max_entries`` bounds
the total (docs/benchmarks.md measures bytes per entry).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from itertools import repeat
from typing import Any

import numpy as np

from zmlcore.messages import NodeState
from zmlcore.messages.kvcache import KvAllCleared, KvBlockRemoved, KvBlockStored, KvEventBatch
from zmlcore.policy.estimate import BODY_BYTES_PER_TOKEN, INF
from zmlcore.policy.prefix.keys import BLOCK_BYTES, KEY_ENDS, KeyChain
from zmlcore.policy.prefix.node import EVENTS_STALE_S, POS_BITS, POS_MASK, NodeCache, kv_geometry

#: An entry untouched this long is dropped (seconds): the safety net for what the index cannot
#: see (other clients of the engine, memory taken by decode) on nodes that report nothing.
DEFAULT_TTL_S = 300.0
#: Entries (key, node) the whole index keeps at most: when the nodes' capacities add up to more,
#: every node's share is scaled down alike (docs/benchmarks.md: bytes per entry). A node's
#: capacity is in prompt bytes; an entry stands for at least BLOCK_BYTES of them.
DEFAULT_MAX_ENTRIES = 2_000_000
#: prompt bytes the key at each position stands for (beyond the previous key's)
_SPAN = [end - (KEY_ENDS[i - 1] if i else 0) for i, end in enumerate(KEY_ENDS)]
#: A reported miss on a prefix confirmed less than this long ago is not taken for an eviction
#: (clocks and reports race by milliseconds, not seconds).
MIN_MISS_AGE_S = 1.0
#: Dispatches whose prediction waits for the engine's report, per node (oldest dropped).
MAX_AWAITING = 1024

class Match:
    """A lookup's result: per group of nodes, how many keys of the chain they hold.

    ``groups`` is a list of ``(slots, nkeys)``, ``slots`` a bitmask over the index's slots;
    ``held`` their union (the holders of the chain's first key).
    """

    __slots__ = ("index", "chain", "groups", "held")

    def __init__(self, index: PrefixIndex, chain: KeyChain, groups: list[tuple[int, int]], held: int = 0) -> None:
        self.index = index
        self.chain = chain
        self.groups = groups
        self.held = held

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
        #: the node's entries by slot (None: free slot)
        self._by_slot: list[NodeCache | None] = []
        self._free: list[int] = []
        #: engine block size by slot (for the vectorised conversion in choose_node); change it
        #: only through _set_block (it keeps the conversions cached by tokens_by_slot)
        self.block_by_slot = np.ones(0, dtype=np.int64)
        self._tokens: dict[int, tuple[np.ndarray, bool]] = {}
        self._slots: dict[int, np.ndarray] = {}
        #: by slot, the time of the node's oldest log entry (INF: none): what the sweep of
        #: other nodes' expiry reads, without touching their (cold) entries
        self._oldest = np.zeros(0)
        #: bumped whenever slots are assigned or freed (tables cache slot -> row maps)
        self.epoch = 0
        self._sweep = 0
        #: the nodes' capacities in prompt bytes, summed, and the share of them the index keeps
        self._total_cap = 0
        self._scale = 1.0

    # --- nodes ---
    def set_node(self, node_id: str, *, block_size: int, capacity_tokens: int) -> None:
        """Declare a node or change its engine's KV geometry."""
        nc = self._nodes.get(node_id)
        if nc is None:
            slot = self._free.pop() if self._free else len(self._ids)
            nc = self._nodes[node_id] = NodeCache(node_id, slot, block_size, 0)
            if slot == len(self._ids):
                self._ids.append(node_id)
                self._by_slot.append(nc)
                self.block_by_slot = np.append(self.block_by_slot, 1)
                self._oldest = np.append(self._oldest, INF)
                self._tokens.clear()
            else:
                self._ids[slot] = node_id
                self._by_slot[slot] = nc
                self._oldest[slot] = INF
            self.epoch += 1
        self._set_block(nc, max(1, block_size))
        self._total_cap += self._bytes_of(capacity_tokens) - self._bytes_of(nc.cap_tokens)
        nc.cap_tokens = capacity_tokens
        self._rescale(nc)

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
        self._evict(nc, nc.size)
        self._total_cap -= self._bytes_of(nc.cap_tokens)
        self._ids[nc.slot] = None
        self._by_slot[nc.slot] = None
        self._free.append(nc.slot)
        self.epoch += 1
        self._rescale(None)

    def node(self, node_id: str) -> NodeCache | None:
        return self._nodes.get(node_id)

    def _set_block(self, nc: NodeCache, block: int) -> None:
        nc.block = block
        if self.block_by_slot.item(nc.slot) != block:
            self.block_by_slot[nc.slot] = block
            self._tokens.clear()

    def slots(self, mask: int) -> np.ndarray:
        """:func:`slot_array` of ``mask``, remembered (a few hundred masks): the holders of a
        shared prefix (a system prompt's first key) come back request after request, and
        change only when a node gains or loses it (a new mask, a new entry)."""
        sa = self._slots.get(mask)
        if sa is None:
            if len(self._slots) >= 256:
                self._slots.clear()
            sa = self._slots[mask] = slot_array(mask)
        return sa

    def tokens_by_slot(self, tokens: int) -> tuple[np.ndarray, bool]:
        """``tokens`` rounded down to whole blocks of each slot's engine (an array by slot),
        and whether that leaves every slot some. Cached per value until a block size changes:
        a match's tokens take few values (a key's end, or the prompt's length less one)."""
        r = self._tokens.get(tokens)
        if r is None:
            if len(self._tokens) >= 256:
                self._tokens.clear()
            b = self.block_by_slot
            a = tokens // b * b
            r = self._tokens[tokens] = (a, bool(len(a)) and a.item(a.argmin()) > 0)
        return r

    def _bytes_of(self, tokens: int) -> int:
        """A capacity in tokens as prompt bytes."""
        return max(0, tokens * self.bytes_per_token)

    def _rescale(self, changed: NodeCache | None) -> None:
        """Each node keeps its capacity in prompt bytes, scaled so that they add up to at most
        ``max_entries`` blocks (no entry stands for less than a block); only a change of the
        scale touches every node."""
        total = self._total_cap
        scale = min(1.0, self.max_entries * BLOCK_BYTES / total) if total else 1.0
        nodes = self._nodes.values() if scale != self._scale or changed is None else (changed,)
        self._scale = scale
        for nc in nodes:
            nc.cap = max(BLOCK_BYTES, int(self._bytes_of(nc.cap_tokens) * scale))
            if nc.size > nc.cap:
                self._evict(nc, nc.size - nc.cap)

    # --- conversions ---
    def to_tokens(self, nkeys: int, block: int, chain: KeyChain, prompt_tokens: int = 0) -> int:
        """Cached tokens for ``nkeys`` matched keys on a node with ``block``-token blocks: the
        matched bytes in tokens, never the whole prompt (the engine computes at least its last
        token), rounded down to whole blocks."""
        if nkeys <= 0:
            return 0
        t = KEY_ENDS[nkeys - 1] // self.bytes_per_token
        total = max(prompt_tokens, chain.nbytes // self.bytes_per_token)
        if t >= total:
            t = total - 1
        return t // block * block

    def keys_for_tokens(self, tokens: int, chain: KeyChain) -> int:
        """Keys of ``chain`` wholly inside its first ``tokens`` tokens."""
        return min(len(chain.keys), bisect_right(KEY_ENDS, tokens * self.bytes_per_token))

    # --- lookup ---
    def lookup(self, chain: KeyChain, now: float = 0.0) -> Match:
        """Every node's matched prefix of ``chain``: O(log L) dict reads per distinct depth."""
        keys = chain.keys
        g = self._holders
        if not keys:
            return Match(self, chain, [], 0)
        v = g.get(keys[0])
        if v is None:
            return Match(self, chain, [], 0)
        held = m0 = (1 << v) if v >= 0 else ~v
        groups: list[tuple[int, int]] = []
        last = len(keys) - 1
        v = g.get(keys[last])
        if v is not None:
            top = m0 & ((1 << v) if v >= 0 else ~v)
            if top:
                groups.append((top, last + 1))
                m0 &= ~top
                if not m0:
                    return Match(self, chain, groups, held)
            last -= 1
        # Each stack entry: nodes ``m`` whose deepest held key is in ``[lo, hi]``.
        stack = [(0, last, m0)]
        while stack:
            lo, hi, m = stack.pop()
            if not m & (m - 1):  # one node (a conversation's): a membership test per step
                s = m.bit_length() - 1
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    v = g.get(keys[mid])
                    if v is not None and (v == s if v >= 0 else (~v >> s) & 1):
                        lo = mid
                    else:
                        hi = mid - 1
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
        return Match(self, chain, groups, held)

    def depth(self, node_id: str, chain: KeyChain) -> int:
        """Keys of ``chain`` the node holds (bisection on its own entries)."""
        nc = self._nodes.get(node_id)
        return 0 if nc is None else _depth(nc.gen, chain.keys)

    # --- approximate: learned from the routers' decisions ---
    def record(self, node_id: str, chain: KeyChain, now: float) -> None:
        """The request of ``chain`` was sent to ``node_id``: the node will hold its prefix.

        Called by the replica that dispatched it and, shared over NATS, by every other replica.
        """
        nc = self._nodes.get(node_id)
        keys = chain.keys
        if nc is None or not keys:
            return
        gen = nc.gen
        d = _depth(gen, keys)
        conf = nc.confirmed.get(gen[keys[d - 1]] >> POS_BITS, -1.0) if d else -1.0
        # recorded, not confirmed: the engine holds it once this request's prefill is done
        n = self._touch(nc, keys, d, now)
        # what was predicted, for the engine's report (correct)
        aw = nc.awaiting
        aw[keys[-1]] = (d, conf, now, n)
        if len(aw) > MAX_AWAITING:
            aw.popitem(last=False)
        ttl_before = now - self.ttl_s
        log = nc.log
        if log and log[0][1] < ttl_before:
            self._expire(nc, now)
        # and another node's, now and then (nodes nobody sends to age too)
        oldest = self._oldest
        s = self._sweep = (self._sweep + 1) % len(oldest)
        if oldest.item(s) < ttl_before:
            other = self._by_slot[s]
            if other is not None:
                self._expire(other, now)

    def _touch(self, nc: NodeCache, keys: list[int], d: int, now: float) -> int:
        """Make ``keys`` (of which the node holds the first ``d``) its most recent entries;
        returns the touch's number."""
        L = len(keys)
        n = nc.touches
        log = nc.log
        if d == L and log and log[-1][0] == n and len(log[-1][2]) == L and nc.gen[keys[-1]] == (n << POS_BITS | L - 1):
            # The node's last touch lists exactly these keys, all still its (a follow-up turn
            # that added no key: most records): a new touch would only renumber them. The same
            # state without the ~2.5 us of dict and log writes: the touch is now, recorded and
            # not confirmed. (Its length and live deepest key pin it: eviction takes a touch's
            # keys deepest first, compaction keeps only live ones; size and cap are unchanged.)
            log[-1] = (n, now, log[-1][2])
            nc.times[n] = now
            nc.confirmed.pop(n, None)
            if len(log) == 1:
                self._oldest[nc.slot] = now
            return n
        if d < L:
            self._add_holder(keys[d:], nc.slot)
            nc.size += KEY_ENDS[L - 1] - (KEY_ENDS[d - 1] if d else 0)
        n = nc.touches = n + 1
        base = n << POS_BITS
        nc.gen.update(zip(keys, range(base, base + L)))
        if not log:
            self._oldest[nc.slot] = now
        log.append((n, now, tuple(keys[::-1])))
        nc.times[n] = now
        nc.log_keys += L
        over = nc.size - nc.cap
        if over > 0:
            self._evict(nc, over)
        if nc.log_keys > 2 * len(nc.gen) + 4096:
            self._compact(nc)
        return n

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

    def _evict(self, nc: NodeCache, nbytes: int, before: float | None = None) -> None:
        """Drop the node's least recently touched entries until ``nbytes`` of prompt are freed
        (or, with ``before``, every entry last touched before that time)."""
        gen, log, slot, hold = nc.gen, nc.log, nc.slot, self._holders
        bit = 1 << slot
        size = nc.size
        i = nc.head
        while log and (nbytes > 0 if before is None else log[0][1] < before):
            num, _t, keys = log[0]
            end = len(keys)
            while i < end and (nbytes > 0 or before is not None):
                k = keys[i]
                i += 1
                g = gen.get(k)
                if g is not None and g >> POS_BITS == num:
                    del gen[k]
                    v = hold.get(k)  # the slot leaves the key's holders
                    if v is not None:
                        if v >= 0:
                            if v == slot:
                                del hold[k]
                        else:
                            m = ~v
                            if m & bit:
                                m ^= bit
                            if m & (m - 1):
                                hold[k] = ~m
                            elif m:
                                hold[k] = m.bit_length() - 1
                            else:
                                del hold[k]
                    span = _SPAN[g & POS_MASK]
                    size -= span
                    nbytes -= span
            if i < end:
                break
            log.popleft()
            i = 0
            nc.log_keys -= end
            del nc.times[num]
            nc.confirmed.pop(num, None)
        nc.head = i
        nc.size = size
        self._oldest[slot] = log[0][1] if log else INF

    def _compact(self, nc: NodeCache) -> None:
        """Drop the log's stale references (keys touched again since, or gone)."""
        gen = nc.gen
        kept: deque[tuple[int, float, tuple[int, ...]]] = deque()
        total = 0
        i = nc.head
        for num, t, keys in nc.log:
            live = tuple([k for k in keys[i:] if gen.get(k, 0) >> POS_BITS == num])
            i = 0
            if live:
                kept.append((num, t, live))
                total += len(live)
            else:
                del nc.times[num]
                nc.confirmed.pop(num, None)
        nc.log = kept
        nc.head = 0
        nc.log_keys = total
        self._oldest[nc.slot] = kept[0][1] if kept else INF

    def _expire(self, nc: NodeCache, now: float) -> None:
        log = nc.log
        # (KV events flowing: evictions come from the engine itself)
        if log and log[0][1] < now - self.ttl_s and (nc.events_at is None or now - nc.events_at > EVENTS_STALE_S):
            self._evict(nc, 0, before=now - self.ttl_s)

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
        that evicted a prefix untouched since ``t`` has evicted everything untouched since:
        the node's entries older than ``t`` are dropped. A miss on a prefix only recorded is
        not evidence (the request that brought it may still have been in the engine's queue).
        ``prompt_tokens`` (the engine's count) converts tokens to the chain's bytes exactly;
        without it the index's bytes-per-token estimate is used.
        """
        nc = self._nodes.get(node_id)
        keys = chain.keys
        if nc is None or not keys:
            return
        pred = nc.awaiting.pop(keys[-1], None)
        gen = nc.gen
        if (pred is not None and gen.get(keys[-1], 0) >> POS_BITS == pred[3]
                and gen.get(keys[0], 0) >> POS_BITS == pred[3]):
            nc.confirmed[pred[3]] = now  # the dispatch's touch: its keys are on the engine now
        else:  # keys touched again since, or lost: one touch of the whole prompt, confirmed
            nc.confirmed[self._touch(nc, keys, _depth(gen, keys), now)] = now
        if pred is None or not pred[0]:
            return
        want, confirmed, sent, _n = pred
        if prompt_tokens > 0 and chain.nbytes > 0:
            got = min(len(keys), bisect_right(KEY_ENDS, cached_tokens * chain.nbytes // prompt_tokens))
        else:
            got = self.keys_for_tokens(cached_tokens, chain)
        if got >= want - 1:  # (block rounding, the bytes-per-token estimate)
            nc.hits += 1
        elif confirmed > 0 and sent - confirmed >= MIN_MISS_AGE_S:
            nc.misses += 1
            self._evict(nc, 0, before=confirmed + 1e-9)

    # --- precise: the engine's KV events ---
    def apply_events(self, node_id: str, batch: KvEventBatch, now: float) -> None:
        """Apply a batch of the node's KV events (vLLM ``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``, bridged into NATS as :class:`~zmlcore.messages.KvEventBatch`).

        The engine speaks token blocks, the index text keys, so events are applied in lockstep
        rather than key by key: a clear empties the node; a removal of ``n`` blocks of ``b``
        tokens evicts that many tokens' worth of prompt from the node's oldest entries (the engine evicts its
        least recently used blocks too, tails first, as the index does), whoever filled them:
        prompts the routers never saw still push the right number of entries out. Stores count
        the engine's occupancy (``stored_tokens``). While events flow, TTL expiry is off for the
        node (the engine's own evictions replace it); the capacity bound stays as a safety net.
        Only the device tier (``medium`` GPU or unset) counts.
        """
        nc = self._nodes.get(node_id)
        if nc is None:
            return
        if batch.block_size > 0 and batch.block_size != nc.block:
            self._set_block(nc, batch.block_size)
        nc.events_at = now
        if batch.seq >= 0:
            nc.event_seq = batch.seq
        for ev in batch.events:
            if isinstance(ev, KvAllCleared):
                self._evict(nc, nc.size)
                nc.stored_tokens = 0
                continue
            if ev.medium not in (None, "GPU", "gpu"):
                continue
            bs = ev.block_size if isinstance(ev, KvBlockStored) and ev.block_size > 0 else nc.block
            tokens = len(ev.block_hashes) * bs
            if isinstance(ev, KvBlockStored):
                nc.stored_tokens += tokens
            elif isinstance(ev, KvBlockRemoved):
                nc.stored_tokens = max(0, nc.stored_tokens - tokens)
                self._evict(nc, tokens * self.bytes_per_token)

    # --- sizes ---
    def __len__(self) -> int:
        """Entries (key, node) held."""
        return sum(len(nc.gen) for nc in self._nodes.values())

    def stats(self) -> dict[str, Any]:
        return {
            "nodes": len(self._nodes), "entries": len(self), "keys": len(self._holders),
            "max_entries": self.max_entries,
        }


def _depth(held: dict[int, int], keys: list[int]) -> int:
    """Leading keys present in a prefix-closed set (bisection)."""
    n = len(keys)
    if not n or keys[0] not in held:
        return 0
    if keys[-1] in held:
        return n
    lo, hi = 1, n - 1  # keys[lo-1] held, keys[hi] not
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def slots_of(mask: int) -> list[int]:
    """Slot numbers set in ``mask``."""
    if not mask & (mask - 1):
        return [mask.bit_length() - 1] if mask else []
    if mask.bit_count() > 24:
        out_: list[int] = slot_array(mask).tolist()
        return out_
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def slot_array(mask: int) -> np.ndarray:
    """Slot numbers set in ``mask``, ascending, as an array (for masks with many bits). (The
    bits as booleans: ``nonzero`` on a bool array costs a sixth of it on uint8.)"""
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little").view(bool).nonzero()[0]
