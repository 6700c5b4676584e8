"""SLO admission: a request's TTFT / TPOT target against each node's predicted TTFT (queue wait
and its own prefill, with that node's prefix cache) and TPOT (that node's decode rate at the
batch it will join). Pure: no I/O, ``now`` is passed in.

A request with a target goes to the policy's pick when that node meets it, else to the node
with the lowest predicted TTFT among those that meet the TPOT target. When no whole node meets
it and the request may be split (``pairs``: the router's candidates for a prefill leg and a
decode leg, zmlcore.policy.split), the split decider's best pair is estimated before refusing:
its TTFT (the decider's: prefill, transfer, the decode node's queue) and its decode node's
TPOT (this module's, as for any node) meeting the targets, the request is admitted split over
that pair. When nothing meets it it is refused at once (SLO_UNATTAINABLE, naming the best
estimate, with a Retry-After when the fleet is expected to meet it once its backlog drains),
never sent to arrive late.

    decision, verdict = admit_slo(nodes, rr, policy, now, state, Slo(ttft_s=0.5, tpot_s=0.05),
                                  stale_after_s=15.0, ttft_bound_s=60.0)

TPOT model (the reference fleet's, zmlcore.fleet.perfmodel): a node decoding ``b`` sequences
takes ``step(b) = (1 + 0.02 (b - 1)) / decode_tps`` per token of each, and pauses decode for the
prefills of arrivals; in steady state at batch ``b`` about ``b / E[O-1]`` prompts arrive per
token step, so ``tpot(b) = step(b) + b E[P] / (E[O-1] pf)``. ``decode_tps`` and ``pf`` are the
node's own (measured or learned by the health service, else its type's profile).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError, QueueFullError, SloUnattainableError
from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY
from zmlcore.messages import NodeState
from zmlcore.policy import admission
from zmlcore.policy.choose import choose_node, is_routable
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, node_speeds
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.policy.resolve import ResolvedPolicy, builtin_policy
from zmlcore.policy.split import KVLinks, Option, SplitIndex, SplitSettings, decide_split, objective_of
from zmlcore.policy.types import Decision, NodeView, RouteRequest, RoutingState

_LATENCY = builtin_policy("latency")
#: Retry-After bounds (s) of an SLO refusal.
RETRY_MIN_S, RETRY_MAX_S = 0.5, 60.0


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's latency targets in seconds (None: no target of that kind)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(frozen=True, slots=True)
class Pairs:
    """What the split decider needs to look for a pair (the router's Splitter gives it, for a
    request it may split): the nodes that may take a leg (``index`` over them for a large
    fleet), [disaggregation]'s settings for the request's model, the KV links, and the nodes no
    leg may take (flow control's ``no_room``)."""

    nodes: Sequence[NodeView]
    settings: SplitSettings
    links: KVLinks
    index: SplitIndex | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class SloVerdict:
    """What admission predicted for the node it chose (reply metadata compares it with what
    happened)."""

    ttft_s: float
    tpot_s: float
    met: bool = True


def tpot_at(st: NodeState, batch: int, mean_prompt: float = MEAN_PROMPT_TOKENS,
            mean_output: float = MEAN_OUTPUT_TOKENS, model: str = "") -> float:
    """Predicted seconds per output token of a sequence on a node decoding ``batch`` sequences.

    >>> st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    >>> round(tpot_at(st, 1) * 1000, 1)        # 60 tok/s alone, a few prefills between tokens
    17.0
    """
    pf, dec, maxc = node_speeds(st, model)  # the learned decode rate for the model, if any
    b = max(1, min(batch, maxc))
    step = (1.0 + DECODE_BATCH_PENALTY * (b - 1)) / dec
    return step + b * mean_prompt / (max(mean_output - 1.0, 1.0) * pf)


class Calibration:
    """Per node and batch (in quarters of the node's slots), how the measured TPOT of finished
    requests compares with what the model predicted at dispatch: a moving average of
    log(actual / predicted) (``alpha`` per request), applied as a factor to the next predictions.
    It absorbs what the model leaves out on that node (a batch that grows after dispatch, a node
    the policy prefers getting prefills faster than it finishes sequences, an engine's own
    scheduling), learned from the router's own replies, no poll needed. By batch because those
    effects differ between a filling node and a full one (per node only, the H100s' median error
    was 14-18% in benches/flow_sim.py; by quarter, 8-16%).

    >>> c = Calibration()
    >>> for _ in range(200): c.observe("h1", 4, 32, predicted=0.020, actual=0.025)
    >>> round(c.factor("h1", 5, 32), 2), c.factor("h1", 30, 32), c.factor("other", 4, 32)
    (1.25, 1.0, 1.0)
    """

    __slots__ = ("alpha", "logs")

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.logs: dict[tuple[str, int], float] = {}

    @staticmethod
    def _key(node_id: str, batch: int, slots: int) -> tuple[str, int]:
        return node_id, min(3, max(0, (batch - 1) * 4 // max(1, slots)))

    def observe(self, node_id: str, batch: int, slots: int, *, predicted: float, actual: float) -> None:
        """A request dispatched at ``batch`` (of ``slots``) with the model's ``predicted`` TPOT
        decoded at ``actual`` seconds per token."""
        if predicted <= 0 or actual <= 0:
            return
        k = self._key(node_id, batch, slots)
        x = math.log(actual / predicted)
        old = self.logs.get(k)
        self.logs[k] = x if old is None else old + self.alpha * (x - old)

    def factor(self, node_id: str, batch: int, slots: int) -> float:
        x = self.logs.get(self._key(node_id, batch, slots))
        return 1.0 if x is None else math.exp(x)


def batch_of(view: NodeView, model: str = "") -> tuple[int, int]:
    """(the batch a request sent to ``view``'s node now joins, the node's slots)."""
    slots = node_speeds(view.state, model)[2]
    return min(view.effective_outstanding() + 1, slots), slots


def model_tpot(view: NodeView, model: str = "") -> float:
    """The model's TPOT of a request sent to ``view``'s node now, uncalibrated: it joins the
    sequences there (capped at the node's slots: beyond them it waits, then decodes at a full batch)."""
    return tpot_at(view.state, view.effective_outstanding() + 1, model=model)


def predict_tpot(view: NodeView, calibration: Calibration | None = None, model: str = "") -> float:
    """TPOT of a request sent to ``view``'s node now: :func:`model_tpot` times the node's
    :class:`Calibration` factor (the router keeps one; None: uncalibrated)."""
    t = model_tpot(view, model)
    if calibration is None:
        return t
    return t * calibration.factor(view.node_id, *batch_of(view, model))


def _find(nodes: Sequence[NodeView], node_id: str) -> NodeView | None:
    get = getattr(nodes, "get", None)  # a FleetIndex looks up by id
    if get is not None:
        found: NodeView | None = get(node_id)
        return found
    for v in nodes:
        if v.node_id == node_id:
            return v
    return None


def _meets(slo: Slo, ttft: float, tpot: float) -> bool:
    return (slo.ttft_s is None or ttft <= slo.ttft_s) and (slo.tpot_s is None or tpot <= slo.tpot_s)


def admit_slo(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float, state: RoutingState,
              slo: Slo, *, stale_after_s: float, ttft_bound_s: float, cache: PrefixIndex | None = None,
              calibration: Calibration | None = None, pairs: Pairs | None = None) -> tuple[Decision, SloVerdict]:
    """:func:`zmlcore.policy.admission.admit`, then the SLO: the policy's pick if it meets it,
    else the lowest-TTFT node that does, else (``pairs`` given: the request may be split) the
    split decider's best pair if it does (a Decision naming its ``prefill_node``);
    SloUnattainableError when none does. QUEUE_FULL (every node saturated) passes through: the
    caller may queue the request with :func:`queue_budget_s`.
    """
    d = admission.admit(nodes, rr, policy, now, state, stale_after_s=stale_after_s, ttft_bound_s=ttft_bound_s,
                        cache=cache)
    view = _find(nodes, d.node_id)
    tpot = predict_tpot(view, calibration, rr.model) if view is not None else 0.0
    if _meets(slo, d.estimated_ttft_s, tpot):
        return d, SloVerdict(d.estimated_ttft_s, tpot)
    # The pick misses: the fastest node among those that meet the TPOT target.
    slow: set[str] = set()
    if slo.tpot_s is not None:
        slow = {v.node_id for v in nodes if predict_tpot(v, calibration, rr.model) > slo.tpot_s}
    best: Decision | None = None
    if rr.accelerator_id is None:
        try:
            best = choose_node(nodes, dataclasses.replace(rr, exclude=rr.exclude | slow), _LATENCY, now, state,
                               stale_after_s=stale_after_s, cache=cache)
        except (QueueFullError, NoHealthyNodesError, ModelNotLoadedError):
            best = None
    if best is not None:
        bview = _find(nodes, best.node_id)
        btpot = predict_tpot(bview, calibration, rr.model) if bview is not None else 0.0
        if _meets(slo, best.estimated_ttft_s, btpot):
            return best, SloVerdict(best.estimated_ttft_s, btpot)
    pair: tuple[Option, float] | None = None
    if pairs is not None and rr.accelerator_id is None:
        # no whole node meets it: the last resort before refusing, so a request is refused only
        # when no way of serving it does (the pair search: 0.1-0.3 ms at 1,000 nodes with an index)
        pair = _best_pair(pairs, nodes, rr, policy, now, slo, best if best is not None else d, slow,
                          stale_after_s, calibration)
        if pair is not None:
            c, ptpot = pair
            if _meets(slo, c.ttft_s, ptpot) and c.ttft_s <= ttft_bound_s:
                dv = _find(nodes, c.node)
                return Decision(node_id=c.node, family=dv.state.family if dv is not None else "", policy=policy.name,
                                queue_depth=dv.effective_outstanding() if dv is not None else 0,
                                estimated_ttft_s=c.ttft_s, prefill_node=c.prefill_node,
                                transfer_tokens=c.transfer_tokens, transfer_s=c.transfer_s), SloVerdict(c.ttft_s, ptpot)
    raise _refusal(nodes, rr, slo, d, tpot, best, now, stale_after_s, policy.name, pair, pairs)


def _best_pair(pairs: Pairs, nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float,
               slo: Slo, whole: Decision, slow: set[str], stale_after_s: float,
               calibration: Calibration | None) -> tuple[Option, float] | None:
    """The split decider's best pair for the request (its own search and estimate, against
    whole on ``whole``, the node admission would have used) and its decode node's predicted
    TPOT; None when there is no pair. No leg on ``pairs.exclude``; no decode leg on a node that
    decodes too slowly for the target (``slow``: they may prefill). ``min_uncached_tokens`` does
    not apply here: a short prompt split beats one refused."""
    wview = _find(nodes, whole.node_id)
    if wview is None:
        return None
    cfg = policy.config
    target = slo.ttft_s if slo.ttft_s is not None else (cfg.latency_target_ms or 2000.0) / 1000.0
    settings = pairs.settings
    if settings.min_uncached_tokens:
        settings = dataclasses.replace(settings, min_uncached_tokens=0)
    sd = decide_split(pairs.nodes, wview, model=rr.model, prompt_tokens=rr.prompt_tokens, output_tokens=rr.max_tokens,
                      cached={whole.node_id: whole.cached_tokens}, settings=settings, links=pairs.links, now=now,
                      objective=objective_of(policy.strategy, cfg.cost_priority), latency_target_s=target,
                      itl_target_s=slo.tpot_s if slo.tpot_s is not None else math.inf,
                      exclude=rr.exclude | pairs.exclude if pairs.exclude else rr.exclude,
                      stale_after_s=stale_after_s, index=pairs.index, no_decode=frozenset(slow))
    c = sd.chosen if sd.split else sd.best_split
    if c is None or not c.prefill_node:
        return None
    dv = _find(nodes, c.node)
    return c, predict_tpot(dv, calibration, rr.model) if dv is not None else c.itl_s


def _refusal(nodes: Sequence[NodeView], rr: RouteRequest, slo: Slo, d: Decision, tpot: float,
             best: Decision | None, now: float, stale_after_s: float, policy: str,
             pair: tuple[Option, float] | None = None, pairs: Pairs | None = None) -> SloUnattainableError:
    usable = [v for v in nodes if is_routable(v, rr.model, now, stale_after_s) is None
              and (rr.accelerator_id is None or v.node_id == rr.accelerator_id)]
    idle_tpot = min((tpot_at(v.state, 1, model=rr.model) for v in usable), default=float("inf"))
    prefills = usable
    if pairs is not None:  # a prefill-only node's prefill counts when the request may be split
        prefills = usable + [v for v in pairs.nodes if is_routable(v, rr.model, now, stale_after_s) == "prefill_only"]
    own_prefill = min((rr.prompt_tokens / node_speeds(v.state, rr.model)[0] for v in prefills),
                      default=float("inf"))
    retry: float | None
    if slo.tpot_s is not None and idle_tpot > slo.tpot_s:
        why, retry = f"no node decodes faster than {idle_tpot * 1000:.0f} ms/token even idle", None
    elif slo.ttft_s is not None and own_prefill > slo.ttft_s:
        why, retry = f"the prompt's prefill alone takes {own_prefill * 1000:.0f} ms on the fastest node", None
    else:
        cand = best if best is not None else d
        over = cand.estimated_ttft_s - (slo.ttft_s if slo.ttft_s is not None else cand.estimated_ttft_s)
        why = (f"best predicted time to first token {cand.estimated_ttft_s * 1000:.0f} ms"
               if best is not None or slo.tpot_s is None else
               f"every node that meets the TPOT target is busy (policy pick: {tpot * 1000:.0f} ms/token)")
        if pair is not None and (slo.tpot_s is None or pair[1] <= slo.tpot_s) and slo.ttft_s is not None:
            over = min(over, pair[0].ttft_s - slo.ttft_s)  # the pair only waits for its backlog
        retry = min(RETRY_MAX_S, max(RETRY_MIN_S, over))
    if pair is not None:
        c, ptpot = pair
        why += (f"; best split ({c.prefill_node} prefills, {c.node} decodes): {c.ttft_s * 1000:.0f} ms to first "
                f"token, {ptpot * 1000:.0f} ms/token")
    target = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s)) if v is not None)
    ctx: dict[str, Any] = {
        "policy": policy,
        "final_error": "slo_unattainable",
        "slo": {k: round(v * 1000) for k, v in (("ttft_ms", slo.ttft_s), ("tpot_ms", slo.tpot_s)) if v is not None},
        "predicted": {"node_id": d.node_id, "ttft_ms": round(d.estimated_ttft_s * 1000),
                      "tpot_ms": round(tpot * 1000, 1)},
    }
    if pair is not None:
        ctx["predicted_split"] = {"prefill_node": pair[0].prefill_node, "node_id": pair[0].node,
                                  "ttft_ms": round(pair[0].ttft_s * 1000), "tpot_ms": round(pair[1] * 1000, 1)}
    return SloUnattainableError(f"no node can meet this request's target ({target}) now: {why}",
                                routing_context=ctx, retry_after=retry)


def queue_budget_s(nodes: Sequence[NodeView], rr: RouteRequest, slo: Slo, now: float,
                   stale_after_s: float) -> float | None:
    """How long a request with a TTFT target may wait in the saturation queue and still meet
    it once dispatched (its own prefill on the fastest serving node subtracted); None: no TTFT
    target. At or below 0 the target cannot be met by waiting: refuse instead."""
    if slo.ttft_s is None:
        return None
    pfs = [node_speeds(v.state, rr.model)[0] for v in nodes if is_routable(v, rr.model, now, stale_after_s) in (None, "saturated")]
    prefill = rr.prompt_tokens / max(pfs) if pfs else 0.0
    return slo.ttft_s - prefill
