"""Which nodes hold which LoRA adapters (pure): on the nodes planned for the adapter's base
model, hot adapters on more of them, each kept where it already is.

An adapter with traffic is loaded on at least one node of its base, and on a share of them
that follows its share of the base's adapter traffic (an adapter with a third of it on a third
of the nodes), so the router finds it loaded instead of loading it on the request's path.
Adapters with no traffic stay only where a slot is free. A node whose adapters are fixed
(llama.cpp's ``--lora`` files: it loads no other) keeps those whose base stays on it, counted
toward the adapter's share, and is given no other.
"""

from __future__ import annotations

import math
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
    base_rate: dict[str, float] = defaultdict(float)
    for a in adapters:
        base_rate[a.base] += a.rate
    hot = sorted((a for a in adapters if a.rate > 0), key=lambda a: (-a.rate, a.adapter))
    for a in hot:
        fixed = sum(1 for n, ms in placed.items() if a.base in ms and by_id[n].adapters_fixed
                    and a.adapter in hold[n])
        nodes = [n for n, ms in placed.items() if a.base in ms and by_id[n].adapter_slots > 0
                 and not by_id[n].adapters_fixed]
        if not nodes:
            continue
        want = max(1, math.ceil((len(nodes) + fixed) * a.rate / base_rate[a.base] - 1e-9)) - fixed
        # where it is already, then the nodes with most room
        nodes.sort(key=lambda n: (a.adapter not in by_id[n].adapters, len(hold[n]), n))
        for n in nodes:
            if want <= 0:
                break
            if len(hold[n]) < by_id[n].adapter_slots:
                hold[n].add(a.adapter)
                want -= 1
    cold = {a.adapter: a.base for a in adapters if a.rate <= 0}
    for n, o in sorted(by_id.items()):
        if o.adapters_fixed:
            continue
        for ad in sorted(o.adapters):
            if ad in cold and cold[ad] in placed.get(n, frozenset()) and len(hold[n]) < o.adapter_slots:
                hold[n].add(ad)
    return {n: frozenset(h) for n, h in hold.items()}
