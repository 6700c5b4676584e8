"""Which node loads which model next (pure: no I/O, time passed in).

:func:`plan_loads` picks, among nodes that should serve a warm model and do not have it,
up to the free load slots (``max_concurrent_loads`` minus loads in progress anywhere), slow
cold-start families first. :func:`keep_warm_due` picks loaded models idle long enough for a
one-token probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zmlcore.fleet.accelerators import ACCELERATORS, canonical_family
from zmlcore.messages import NodeState


@dataclass(frozen=True, slots=True)
class Want:
    """A node configured (zml.toml or registry) to serve these models."""

    node_id: str
    accelerator: str
    family: str
    models: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Load:
    node_id: str
    model: str


def cold_start_key(want: Want, priority_families: Iterable[str]) -> tuple[int, float, str]:
    """Sort key: priority families first (in their order), then longest typical load time."""
    prio = [canonical_family(f).lower() for f in priority_families]
    fam = canonical_family(want.family).lower()
    rank = prio.index(fam) if fam in prio else len(prio)
    load_time = ACCELERATORS[want.accelerator].load_time_s if want.accelerator in ACCELERATORS else 0.0
    return (rank, -load_time, want.node_id)


def loads_in_progress(states: Mapping[str, NodeState], ours: Iterable[tuple[str, str]]) -> set[str]:
    """Nodes loading something now: ours, or any the health state says are loading."""
    busy = {node for node, _ in ours}
    busy.update(n for n, st in states.items() if st.loading_models)
    return busy


def plan_loads(*, wants: Iterable[Want], states: Mapping[str, NodeState], warm_models: Iterable[str],
               quiet: Mapping[str, bool], in_progress: Iterable[tuple[str, str]], max_concurrent: int,
               priority_families: Iterable[str], blocked: Iterable[tuple[str, str]] = ()) -> list[Load]:
    """Loads to start now (possibly none). ``blocked``: (node, model) pairs to skip (recent
    failures backing off)."""
    progress = list(in_progress)
    busy = loads_in_progress(states, progress)
    slots = max_concurrent - len(busy)
    if slots <= 0:
        return []
    warm = set(warm_models)
    skip = set(blocked) | set(progress)
    prio = list(priority_families)
    out: list[Load] = []
    for want in sorted(wants, key=lambda w: cold_start_key(w, prio)):
        if want.node_id in busy:
            continue
        st = states.get(want.node_id)
        if st is None or st.status != "up":
            continue  # down, loading its engine, invalid, or unknown: not ours to touch
        for model in want.models:
            if model not in warm or not quiet.get(model, False) or (want.node_id, model) in skip:
                continue
            if model in st.models or model in st.loading_models:
                continue
            out.append(Load(want.node_id, model))
            busy.add(want.node_id)
            break  # one load per node at a time
        if len(out) >= slots:
            break
    return out


def keep_warm_due(*, states: Mapping[str, NodeState], keep_warm: Mapping[str, float],
                  last_used: Mapping[tuple[str, str], float], now: float) -> list[Load]:
    """(node, model) pairs loaded and up but idle for at least the model's keep_warm_after_s.
    ``last_used`` holds the last request or probe per pair (absent: use the node's
    last_inference_at)."""
    out: list[Load] = []
    for node_id, st in sorted(states.items()):
        if st.status != "up":
            continue
        for model in st.models:
            after = keep_warm.get(model)
            if after is None:
                continue
            last = last_used.get((node_id, model), st.last_inference_at)
            if now - last >= after:
                out.append(Load(node_id, model))
    return out
