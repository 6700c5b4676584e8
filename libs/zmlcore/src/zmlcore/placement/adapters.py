"""Which nodes hold which LoRA adapters (pure): on the nodes planned for the adapter's base
model, hot adapters on more of them, each kept where it already is.

An adapter with traffic is loaded on at least one node of its base, then on more of them in
proportion to its traffic (D'Hondt: the most requests per copy next) until the base's nodes'
adapter slots are full, so the router finds it loaded instead of loading it on the request's
path, and can balance its requests like the base's.
Adapters with no traffic stay only where a slot is free. A node whose adapters are fixed
(llama.cpp's ``--lora`` files: it loads no other) keeps those whose base stays on it, counted
toward the adapter's share, and is given no other.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence

from zmlcore.placement.inputs import AdapterDemand, NodeOffer


def place_adapters(offers: Sequence[NodeOffer], placed: Mapping[str, frozenset[str]],
                   adapters: Sequence[AdapterDemand]) -> dict[str, frozenset[str]]:
    """node -> adapters it should hold, given the base-model placement ``placed``."""
    by_id = {o.node_id: o for o in offers}
    hold: dict[str, set[str]] = {o.node_id: set() for o in offers}
    base_of = {a.adapter: a.base for a in adapters}
    for o in offers:
        if o.adapters_fixed:
            hold[o.node_id] = {ad for ad in o.adapters
                               if base_of.get(ad, "") in placed.get(o.node_id, frozenset())}
    copies: dict[str, int] = defaultdict(int)
    for n, h in hold.items():
        for ad in h:
            copies[ad] += 1
    homes: dict[str, list[str]] = defaultdict(list)
    for n, ms in sorted(placed.items()):
        if by_id[n].adapter_slots > 0 and not by_id[n].adapters_fixed:
            for m in ms:
                homes[m].append(n)

    def put(a: AdapterDemand) -> bool:
        """One more copy of ``a``: where it already is, else on the node with most room."""
        free = [n for n in homes.get(a.base, ()) if a.adapter not in hold[n] and len(hold[n]) < by_id[n].adapter_slots]
        if not free:
            return False
        n = min(free, key=lambda n: (a.adapter not in by_id[n].adapters, len(hold[n]), n))
        hold[n].add(a.adapter)
        copies[a.adapter] += 1
        return True

    # every adapter with traffic on one node of its base first (hottest first), then more
    # copies, the most requests per copy next (D'Hondt), into every free slot: an adapter's
    # requests go only where it is loaded, so the one copy of a busy adapter takes all its
    # traffic however queued its node is, where copies on every node of the base let the router
    # balance it like the base's own requests (a day simulated request by request: the nodes
    # with the few copies stayed queued after a move while the base's new replicas idled)
    hot = sorted((a for a in adapters if a.rate > 0), key=lambda a: (-a.rate, a.adapter))
    for a in hot:
        if not copies[a.adapter]:
            put(a)
    queue = [(-a.rate / (copies[a.adapter] + 1), a.adapter, i) for i, a in enumerate(hot)]
    heapq.heapify(queue)
    while queue:
        _, _, i = heapq.heappop(queue)
        if put(hot[i]):
            heapq.heappush(queue, (-hot[i].rate / (copies[hot[i].adapter] + 1), hot[i].adapter, i))
    cold = {a.adapter: a.base for a in adapters if a.rate <= 0}
    for n, o in sorted(by_id.items()):
        if o.adapters_fixed:
            continue
        for ad in sorted(o.adapters):
            if ad in cold and cold[ad] in placed.get(n, frozenset()) and len(hold[n]) < o.adapter_slots:
                hold[n].add(ad)
    return {n: frozenset(h) for n, h in hold.items()}
