"""The steps from the placement a fleet holds to a planned one, make before break (pure).

:func:`next_steps` is asked again after every step finishes (the warmup service calls it each
sweep with what the nodes report), so a node that fails, or a load that takes long, changes
the next answer instead of a script going stale. Its rules:

* **load** a planned model on a node that has a free slot for it;
* **unload** a model from a node the plan takes it off only when every node the plan gives
  that model serves it already (loaded, up): the model's SLO capacity never dips below the
  plan's while it moves. A node whose slots are full unloads first what it must lose, under
  the same rule, and loads after;
* adapters the same way, within the node's adapter slots, on nodes that serve their base, and
  make before break too: an adapter leaves a node (unloaded, or with its base model) only once
  a node the plan gives it has it loaded, or its requests would find it nowhere and be refused
  (MODEL_NOT_LOADED) until a load elsewhere finishes;
* at most ``max_loads`` loads at a time, fleet-wide, counting those in progress, the loads of
  models short of capacity first;
* with ``capacity`` and ``demand`` given, a model short of capacity (``urgent``) does not wait
  for another model's moves: on the placement day its loads waited up to 6 minutes for a full
  node whose model could leave only once that model's own new replicas loaded. So a full node
  an urgent load waits for unloads what it must lose early where the nodes still serving that
  model give it SLO capacity for its demand (below the plan's, never below its demand), and
  meanwhile the urgent model loads on a *stand-in*, a node the plan leaves idle that can serve
  it, one per waiting load; the stand-in is then a model on a node the plan takes it off, and
  unloads by the make-before-break rule once every planned node serves it.

Steps that cannot run yet (their model's new replicas still loading) wait; a plan whose
moves would need a spare node it does not have (two nodes swapping their only replicas) is
reported as ``blocked`` rather than dropping a model.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

StepKind = Literal["load", "unload", "load_adapter", "unload_adapter"]


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    node_id: str
    #: A model for load/unload, an adapter for load_adapter/unload_adapter.
    name: str
    #: Why it waits ("" when it can run now).
    waiting: str = ""

    def __str__(self) -> str:
        verb = {"load": "load", "unload": "unload", "load_adapter": "load adapter",
                "unload_adapter": "unload adapter"}[self.kind]
        return f"{verb} {self.name} on {self.node_id}" + (f" (waits: {self.waiting})" if self.waiting else "")


@dataclass(frozen=True, slots=True)
class NodeNow:
    """A node as its engine reports it now."""

    models: frozenset[str]
    loading: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    up: bool = True
    slots: int = 1
    adapter_slots: int = 0
    #: Its adapters come and go with its models (llama.cpp: ``--lora`` files from start, per
    #: model in router mode): it takes no adapter step of its own.
    adapters_fixed: bool = False


def all_steps(now: Mapping[str, NodeNow], target: Mapping[str, frozenset[str]],
              target_adapters: Mapping[str, frozenset[str]] | None = None) -> list[Step]:
    """Every step between ``now`` and ``target`` (for ``zml plan``), in the order they can run."""
    out: list[Step] = []
    for n in sorted(set(now) | set(target)):
        have = now.get(n, NodeNow(frozenset())).models
        want = target.get(n, frozenset())
        out += [Step("load", n, m) for m in sorted(want - have)]
    for n in sorted(now):
        want = target.get(n, frozenset())
        out += [Step("unload", n, m) for m in sorted(now[n].models - want)]
    if target_adapters is not None:
        for n in sorted(set(now) | set(target_adapters)):
            if n in now and now[n].adapters_fixed:
                continue
            have_a = now.get(n, NodeNow(frozenset())).adapters
            want_a = target_adapters.get(n, frozenset())
            out += [Step("load_adapter", n, a) for a in sorted(want_a - have_a)]
            out += [Step("unload_adapter", n, a) for a in sorted(have_a - want_a)]
    return out


def next_steps(now: Mapping[str, NodeNow], target: Mapping[str, frozenset[str]], *,
               target_adapters: Mapping[str, frozenset[str]] | None = None,
               adapter_base: Mapping[str, str] | None = None, max_loads: int = 1,
               in_progress: int = 0, urgent: Collection[str] = (),
               capacity: Mapping[str, Mapping[str, float]] | None = None,
               demand: Mapping[str, float] | None = None) -> tuple[list[Step], list[Step]]:
    """(steps to start now, steps waiting with the reason). Nodes absent from ``target`` keep
    what they hold (the plan did not cover them). Loads of ``urgent`` models (short of SLO
    capacity now) take the ``max_loads`` budget first. ``capacity`` (node -> model -> SLO
    requests/s holding only that model, ``NodeOffer.capacity``) and ``demand`` (model ->
    requests/s, its adapters' included) let a node an urgent load waits for unload early (see
    the module docstring)."""
    run: list[Step] = []
    wait: list[Step] = []
    placed_ok: dict[str, bool] = {}
    #: SLO capacity taken from each model by the early unloads of this call
    taken: dict[str, float] = {}

    def spare(model: str, node: str) -> bool:
        """``model`` keeps SLO capacity for its demand without ``node`` (and this call's other
        early unloads): the nodes serving it now, each's time shared among its models."""
        if capacity is None or demand is None:
            return False
        have = sum(capacity.get(o, {}).get(model, 0.0) / max(1, len(h.models))
                   for o, h in now.items() if o != node and h.up and model in h.models and model not in h.loading)
        mine = capacity.get(node, {}).get(model, 0.0) / max(1, len(now[node].models))
        if have - taken.get(model, 0.0) < demand.get(model, 0.0):
            return False
        taken[model] = taken.get(model, 0.0) + mine
        return True

    def replicas_ready(model: str) -> bool:
        """Every node planned for ``model`` serves it now."""
        if model not in placed_ok:
            placed_ok[model] = all(
                model in now[n].models and model not in now[n].loading and now[n].up
                for n, ms in target.items() if model in ms and n in now)
        return placed_ok[model]

    ad_ok: dict[str, bool] = {}
    base_of = adapter_base or {}

    def adapter_ready(adapter: str) -> bool:
        """``adapter`` may leave a node: a node the plan gives it has it loaded (its requests
        still find it), or none could load it before something leaves (every such node's
        adapter slots are full: waiting would block both), or the plan gives it no node."""
        if target_adapters is None:
            return True
        if adapter not in ad_ok:
            homes = [now[n] for n, ads in target_adapters.items() if adapter in ads and n in now and now[n].up]
            ad_ok[adapter] = (not homes or any(adapter in h.adapters for h in homes)
                              or all(len(h.adapters) >= h.adapter_slots for h in homes))
        return ad_ok[adapter]

    loads_left = max_loads - in_progress
    loadable: list[tuple[str, str]] = []
    for n in sorted(now):
        node = now[n]
        if n not in target or not node.up:
            continue
        want = target[n]
        drops = sorted(node.models - want)
        adds = sorted(want - node.models - node.loading)
        # an urgent load waits for this node's slot
        pressed = any(m in urgent for m in adds) and node.slots - len(node.models) - len(node.loading) < len(adds)
        for m in drops:
            if not replicas_ready(m) and not (pressed and spare(m, n)):
                wait.append(Step("unload", n, m, "its new replicas are not serving yet"))
            elif not all(adapter_ready(a) for a in node.adapters if base_of.get(a) == m):
                wait.append(Step("unload", n, m, "its adapters are not loaded where the plan puts them yet"))
            else:
                run.append(Step("unload", n, m))
        free = node.slots - len(node.models) - len(node.loading)
        for m in adds:
            if free <= 0:
                wait.append(Step("load", n, m, "the node's slots are full until it unloads"))
            else:
                loadable.append((n, m))
                free -= 1
    # stand-ins: an urgent load that waits for a full node's slot goes meanwhile to a node the
    # plan leaves idle (and holding nothing), which serves the model until the planned node
    # does; then it is a model on a node the plan takes it off, unloaded by the rule above
    if capacity is not None:
        blocked_urgent = [s.name for s in wait if s.kind == "load" and s.name in urgent
                          and s.waiting == "the node's slots are full until it unloads"]
        idle = [n for n in sorted(now) if n in target and not target[n] and now[n].up
                and not now[n].models and not now[n].loading]
        # stand-ins already there (holding or loading the model off its planned nodes)
        standing = {m: sum(1 for n, h in now.items() if (m in h.models or m in h.loading)
                           and m not in target.get(n, frozenset())) for m in set(blocked_urgent)}
        for m in blocked_urgent:
            if standing[m] > 0:
                standing[m] -= 1
                continue
            best = max(idle, key=lambda n: (capacity.get(n, {}).get(m, 0.0), n), default=None)
            if best is not None and capacity.get(best, {}).get(m, 0.0) > 0:
                idle.remove(best)
                loadable.append((best, m))
    # the load budget goes to models short of capacity first (their requests queue meanwhile),
    # then to those whose loads only save money
    for n, m in sorted(loadable, key=lambda nm: (nm[1] not in urgent, nm)):
        if loads_left <= 0:
            wait.append(Step("load", n, m, "another load is in progress"))
        else:
            run.append(Step("load", n, m))
            loads_left -= 1
    if target_adapters is not None:
        for n in sorted(now):
            node = now[n]
            if n not in target_adapters or not node.up or node.adapters_fixed:
                continue
            want_a = target_adapters[n]
            leaving = 0
            for a in sorted(node.adapters - want_a):
                if adapter_ready(a) or base_of.get(a, "") not in node.models:
                    run.append(Step("unload_adapter", n, a))
                    leaving += 1
                else:
                    wait.append(Step("unload_adapter", n, a, "no node the plan gives it has loaded it yet"))
            # a slot an adapter still serving here holds is free once it leaves, not before
            free = node.adapter_slots - len(node.adapters) + leaving
            for a in sorted(want_a - node.adapters):
                b = base_of.get(a)
                if b is not None and (b not in node.models or b in node.loading):
                    wait.append(Step("load_adapter", n, a, f"base model {b} is not loaded yet"))
                elif free <= 0:
                    wait.append(Step("load_adapter", n, a, "the node's adapter slots are full"))
                else:
                    run.append(Step("load_adapter", n, a))
                    free -= 1
    return run, wait


def blocked(now: Mapping[str, NodeNow], target: Mapping[str, frozenset[str]], wait: list[Step],
            run: list[Step], in_progress: int) -> bool:
    """True when nothing can move although the plan is not reached: each remaining unload
    waits for a load that waits for that unload (the plan needs a spare node)."""
    return not run and in_progress == 0 and any(s.kind in ("load", "unload") for s in wait)
