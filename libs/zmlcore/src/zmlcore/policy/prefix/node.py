"""What the prefix index knows about one node: its entries (:class:`NodeCache`) and its
engine's KV geometry. Internal to :mod:`zmlcore.policy.prefix` (``index.py`` keeps them)."""

from __future__ import annotations

from collections import OrderedDict, deque

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.messages import NodeState

#: ``gen`` values: touch number << POS_BITS | the key's position in its chain.
POS_BITS = 6
POS_MASK = (1 << POS_BITS) - 1
#: With no event for this long, a node's events are no longer trusted to evict (seconds).
EVENTS_STALE_S = 30.0

#: Default KV geometry by accelerator type when the node reports none: (block size in tokens,
#: cached tokens), from the accelerator table (zmlcore.fleet.accelerators, the one source the
#: simulated nodes use too).
KV_DEFAULTS: dict[str, tuple[int, int]] = {t: (a.kv_block_size, a.kv_cache_tokens) for t, a in ACCELERATORS.items()}
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
        "node_id", "slot", "gen", "log", "head", "log_keys", "touches", "times", "confirmed", "block", "cap_tokens",
        "cap", "size", "awaiting", "events_at", "event_seq", "stored_tokens", "hits", "misses",
    )

    def __init__(self, node_id: str, slot: int, block: int, cap_tokens: int) -> None:
        self.node_id = node_id
        self.slot = slot
        #: key -> (number of its last touch) << 6 | its position in the chain
        self.gen: dict[int, int] = {}
        #: touches, oldest first: (number, time, keys deepest first), and the next position to
        #: evict in the oldest. Tuples of numbers: the garbage collector stops tracking them
        #: after one look, so a million entries add nothing to what a full collection scans.
        self.log: deque[tuple[int, float, tuple[int, ...]]] = deque()
        self.head = 0
        self.log_keys = 0
        self.touches = 0
        #: touch -> its time, for the touches in the log; touch -> when the engine confirmed it
        self.times: dict[int, float] = {}
        self.confirmed: dict[int, float] = {}
        #: engine block size (tokens): a match counts whole blocks only
        self.block = max(1, block)
        #: tokens the engine can keep; prompt bytes the index keeps for it (its scaled share),
        #: and holds now
        self.cap_tokens = cap_tokens
        self.cap = 0
        self.size = 0
        #: chain tail -> (keys predicted cached at dispatch, when the engine had confirmed the
        #: deepest of them or -1 if it was only recorded, the dispatch time, the dispatch's touch)
        self.awaiting: OrderedDict[int, tuple[int, float, float, int]] = OrderedDict()
        #: last KV event batch (time received, engine sequence number); None: never
        self.events_at: float | None = None
        self.event_seq = -1
        #: engine tokens stored per its events
        self.stored_tokens = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.gen)

    def __contains__(self, key: int) -> bool:
        return key in self.gen

    def touched(self, key: int) -> float | None:
        """When ``key`` was last touched: when the engine confirmed that touch, or minus the
        time it was recorded while unconfirmed; None if the node does not hold it."""
        g = self.gen.get(key)
        if g is None:
            return None
        n = g >> POS_BITS
        c = self.confirmed.get(n)
        return c if c is not None else -self.times[n]

    def fidelity(self, now: float) -> str:
        """``precise`` (KV events are flowing), ``reported`` (the engine reports cached tokens),
        else ``approximate`` (learned from routing decisions only)."""
        if self.events_at is not None and now - self.events_at <= EVENTS_STALE_S:
            return "precise"
        return "reported" if self.hits + self.misses else "approximate"
