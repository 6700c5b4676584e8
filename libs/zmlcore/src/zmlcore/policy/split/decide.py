"""Split a request into a prefill leg and a decode leg, or serve it whole: the per-request
decision. Pure: no I/O, time passed in; the router, the routing simulator (benches/) and the
benchmarks call it alike.

For a prompt of ``P`` tokens and ``O`` expected output tokens, each option is estimated from the
nodes' measured speeds (``node_speeds``: prefill ``pf``, decode ``r(b)`` per sequence at batch
``b``), their queues as this router sees them, their prefix caches (``cached``) and prices:

* whole on node ``n`` (the policy's own pick): ``ttft = wait(n) + (P - C_n) / pf_n``, each
  later token at ``n``'s batch step; its prefill pauses the ``b_n`` sequences decoding there
  (``(P - C_n) / pf_n x b_n`` sequence-seconds of stall: the interference splitting removes);
* split on ``(p, d)``: ``ttft = wait(p) + (P - C_p) / pf_p + KV bytes of (P - C_d) / link +
  d's prefill queue and slot wait``, each later token at ``d``'s batch step, the stall falling
  on ``p``'s decoding sequences (none on a prefill-only node). ``d`` pulls only what its own
  cache lacks, so a decode node holding the conversation needs little transfer.

The score is the objective's: ``latency`` minimises time spent (``ttft + (O-1) itl`` plus the
stall imposed on others), each second of TTFT past the policy's target counting
:data:`LATE_WEIGHT` times; ``cost`` minimises dollars (the prefill node whole for its prefill
time, one of ``d``'s sequence slots for the decode) among options within the TTFT target.
Which kinds prefill and which decode follows from those numbers, never from family names.
A split needs ``min_uncached_tokens`` uncached on its decode node and a score better than
whole by ``min_gain``; a conversation that split keeps splitting until whole is better by
``min_gain`` (hysteresis: decisions do not flip on noise).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY
from zmlcore.policy.choose import is_routable
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, node_speeds
from zmlcore.policy.split.index import SplitIndex
from zmlcore.policy.split.links import KVLinks
from zmlcore.policy.types import NodeView

Objective = Literal["latency", "cost"]
Mode = Literal["split", "whole"]

#: Candidates of each leg kept (by their own part of the score: time, and for the cost
#: objective dollars too) before the pair search: the pair's transfer is all that couples them.
PAIR_WIDTH = 4
#: A score for options past the TTFT target under the cost objective: dollars per second late,
#: far above any request's price, so any option within the target wins.
_LATE_DOLLARS_PER_S = 1000.0
#: Latency objective: weight of each second of time to first token past the policy's target.
LATE_WEIGHT = 10.0
_GBIT = 1e9 / 8.0
_INF = float("inf")


@dataclass(slots=True, frozen=True)
class SplitSettings:
    """[disaggregation] as the decider reads it."""

    min_uncached_tokens: int = 512
    min_gain: float = 0.1
    kv_bytes_per_token: float = 131072.0
    #: Split whenever a pair exists (the estimate only picks the pair).
    always: bool = False


@dataclass(slots=True, frozen=True)
class Option:
    """One way to serve the request, estimated. ``prefill_node`` "" means whole on ``node``."""

    node: str
    prefill_node: str = ""
    ttft_s: float = 0.0
    itl_s: float = 0.0
    #: Time spent: ttft + (O-1) itl + stall imposed on the other sequences of the prefilling node.
    time_s: float = 0.0
    dollars: float = 0.0
    #: Prompt tokens computed by the prefilling node / moved over the link, and the move's time.
    prefill_tokens: int = 0
    transfer_tokens: int = 0
    transfer_s: float = 0.0
    score: float = 0.0


@dataclass(slots=True, frozen=True)
class SplitDecision:
    """``split``: run ``chosen.prefill_node`` then ``chosen.node``; else whole on ``chosen.node``.
    ``reason``: short_prompt, no_pair, whole_better, split_better, always (split by
    [disaggregation] always though not estimated better), or no_node when nothing is routable."""

    split: bool
    reason: str
    chosen: Option | None
    whole: Option | None
    best_split: Option | None = None

    @property
    def mode(self) -> Mode:
        return "split" if self.split else "whole"


class _Node:
    """One node's figures for this decision (read once from its view)."""

    __slots__ = ("v", "pf", "dec", "maxc", "cost", "wait_prefill", "slot_wait", "decoding", "step_next")

    def __init__(self, v: NodeView, mean_prompt: float, mean_output: float) -> None:
        st = v.state
        self.v = v
        pf, dec, maxc = node_speeds(st)
        self.pf, self.dec, self.maxc = pf, dec, maxc
        self.cost = st.cost_per_hour
        out = v.effective_outstanding()
        pending = v.effective_pending()
        tokens = v.effective_pending_tokens(mean_prompt)
        ahead = (pending * mean_prompt if tokens is None else tokens) / pf
        full_step = (1.0 + DECODE_BATCH_PENALTY * (maxc - 1)) / dec
        q = out + 1 - maxc
        self.slot_wait = q * max(mean_output - 1.0, 0.0) * full_step / maxc if q > 0 else 0.0
        self.wait_prefill = ahead + self.slot_wait
        self.decoding = max(0, min(out, maxc) - pending)
        b = min(out + 1, maxc)
        self.step_next = (1.0 + DECODE_BATCH_PENALTY * (b - 1)) / dec

    @classmethod
    def of_row(cls, index: SplitIndex, j: int) -> _Node:
        """The same terms, read from the index's columns (kept by the same formulas)."""
        n = cls.__new__(cls)
        n.v = index.views[j]
        n.pf, n.dec, n.maxc = float(index.pf[j]), float(index.dec[j]), int(index.maxc[j])
        n.cost = float(index.cost[j])
        n.wait_prefill = float(index.wait[j])
        n.decoding = int(index.decoding[j])
        n.step_next = float(index.step_next[j])
        n.slot_wait = 0.0  # (folded into wait_prefill)
        return n


def _score(objective: Objective, ttft: float, time_s: float, dollars: float, target_s: float,
           itl_late: float = 0.0) -> float:
    """``itl_late``: the seconds of decode past the request's inter-token target (0: within it)."""
    if objective == "cost":
        return dollars if ttft <= target_s and not itl_late else _LATE_DOLLARS_PER_S * time_s
    # each second of time to first token past the target counts LATE_WEIGHT times: a pair whose
    # fast decoder is worth more than its late first token still wins, one barely faster does not
    score = time_s + LATE_WEIGHT * (ttft - target_s) if ttft > target_s else time_s
    return score + LATE_WEIGHT * itl_late if itl_late else score


def _itl_late(out_tokens: int, itl: float, itl_target_s: float) -> float:
    """Seconds of a decode past its inter-token target: (O-1) x the excess of each step."""
    return (out_tokens - 1) * (itl - itl_target_s) if itl > itl_target_s else 0.0


def _whole(n: _Node, prompt: int, cached: int, out_tokens: int, objective: Objective, target_s: float,
           itl_target_s: float) -> Option:
    unc = max(prompt - cached, 1)
    pre = unc / n.pf
    ttft = n.wait_prefill + pre
    itl = n.step_next
    time_s = ttft + (out_tokens - 1) * itl + pre * n.decoding
    dollars = n.cost / 3600.0 * (pre + (out_tokens - 1) * itl / n.maxc)
    return Option(node=n.v.node_id, ttft_s=ttft, itl_s=itl, time_s=time_s, dollars=dollars, prefill_tokens=unc,
                  score=_score(objective, ttft, time_s, dollars, target_s, _itl_late(out_tokens, itl, itl_target_s)))


def decide_split(
    nodes: Sequence[NodeView],
    whole: NodeView | None,
    *,
    model: str,
    prompt_tokens: int,
    output_tokens: int,
    cached: Mapping[str, int],
    settings: SplitSettings,
    links: KVLinks,
    now: float,
    objective: Objective = "latency",
    latency_target_s: float = 2.0,
    itl_target_s: float = _INF,
    previous: Mode | None = None,
    exclude: frozenset[str] = frozenset(),
    stale_after_s: float = 15.0,
    mean_prompt: float = MEAN_PROMPT_TOKENS,
    mean_output: float = MEAN_OUTPUT_TOKENS,
    index: SplitIndex | None = None,
    decode_node: str | None = None,
    no_decode: frozenset[str] = frozenset(),
) -> SplitDecision:
    """Whole on ``whole`` (the policy's pick) or split over the best pair of ``nodes``.

    ``cached``: prompt tokens each node holds in its prefix cache (absent: none);
    ``previous``: this conversation's last mode, for the hysteresis; ``index``: a
    :class:`~zmlcore.policy.split.index.SplitIndex` over ``nodes`` (a large fleet: the legs'
    candidates come from its columns instead of a pass over ``nodes``); ``decode_node``: the
    only node that may decode (a split whose prefill leg failed looks for another prefill
    node for the same decode node; ``whole`` is then that node); ``no_decode``: nodes that may
    take the prefill leg but not the decode leg (SLO admission's: they decode too slowly for the
    request's TPOT target, zmlcore.flowctl.slo).

    >>> from zmlcore.messages import NodeState
    >>> def node(i, acc, roles):
    ...     return NodeView(NodeState(node_id=i, accelerator_type=acc, family="", endpoint="", status="up",
    ...                               models=["m"], roles=roles, kv_group="g", kv_gbps=400.0, updated_at=0.0))
    >>> p, d = node("p", "nvidia_h100", ["prefill"]), node("d", "intel_gaudi2", ["decode"])
    >>> d.outstanding = 8
    >>> dec = decide_split([p, d], d, model="m", prompt_tokens=6000, output_tokens=200, cached={},
    ...                    settings=SplitSettings(), links=KVLinks(), now=0.0)
    >>> dec.split, dec.chosen.prefill_node, dec.chosen.node
    (True, 'p', 'd')
    >>> decide_split([p, d], d, model="m", prompt_tokens=100, output_tokens=200, cached={},
    ...              settings=SplitSettings(), links=KVLinks(), now=0.0).reason
    'short_prompt'
    """
    out_tokens = max(int(output_tokens), 1)
    prompt = max(int(prompt_tokens), 1)
    if whole is None:
        return SplitDecision(False, "no_node", None, None)
    w = _Node(whole, mean_prompt, mean_output)
    whole_opt = _whole(w, prompt, cached.get(whole.node_id, 0), out_tokens, objective, latency_target_s,
                       itl_target_s)
    no = SplitDecision(False, "whole_better", whole_opt, whole_opt)
    # a short prompt is served whole, unless its node decodes too slowly for the request
    min_unc = settings.min_uncached_tokens if whole_opt.itl_s <= itl_target_s else 0
    if prompt - max(cached.values(), default=0) < min_unc:
        return SplitDecision(False, "short_prompt", whole_opt, whole_opt)
    best_key: tuple[float, str, str] | None = None
    best_pair: tuple[_Node, int, _Node, int, float] | None = None
    if index is not None:  # a large fleet: the same search as vector operations on the index's columns
        found = index.best_pair(model, prompt, out_tokens, cached, min_unc, exclude, now,
                                stale_after_s, PAIR_WIDTH, objective == "cost", settings.kv_bytes_per_token,
                                links.explicit, latency_target_s, LATE_WEIGHT, _LATE_DOLLARS_PER_S, decode_node,
                                itl_target_s, no_decode)
        if found is not None:
            pj, dj, xfer, score = found
            p, d = (w if index.views[j] is whole else _Node.of_row(index, j) for j in (pj, dj))
            best_key = (score, p.v.node_id, d.v.node_id)
            best_pair = (p, cached.get(p.v.node_id, 0), d, cached.get(d.v.node_id, 0), xfer)
    else:
        best_key, best_pair = _scan(nodes, w, whole, model, prompt, out_tokens, cached, settings, links, now,
                                    objective, latency_target_s, exclude, stale_after_s, mean_prompt, mean_output,
                                    decode_node, min_unc, itl_target_s, no_decode)
    best: Option | None = None
    if best_pair is not None and best_key is not None:
        p, cp, d, cd, xfer = best_pair
        unc = max(prompt - cp, 1)
        pre = unc / p.pf
        ttft = p.wait_prefill + pre + xfer + d.wait_prefill + 1.0 / d.pf
        itl = d.step_next
        best = Option(node=d.v.node_id, prefill_node=p.v.node_id, ttft_s=ttft, itl_s=itl,
                      time_s=ttft + (out_tokens - 1) * itl + pre * p.decoding,
                      dollars=p.cost / 3600.0 * pre + d.cost / 3600.0 * (out_tokens - 1) * itl / d.maxc,
                      prefill_tokens=unc, transfer_tokens=max(prompt - cd, 0), transfer_s=xfer, score=best_key[0])
    if best is None:
        return SplitDecision(False, "no_pair", whole_opt, whole_opt)
    gain = settings.min_gain
    bound = whole_opt.score * (1.0 + gain if previous == "split" else 1.0 - gain)
    if best.score < bound or settings.always:
        return SplitDecision(True, "split_better" if best.score < bound else "always", best, whole_opt, best)
    return SplitDecision(False, no.reason, whole_opt, whole_opt, best)


def _scan(nodes: Sequence[NodeView], w: _Node, whole: NodeView, model: str, prompt: int, out_tokens: int,
          cached: Mapping[str, int], settings: SplitSettings, links: KVLinks, now: float, objective: Objective,
          latency_target_s: float, exclude: frozenset[str], stale_after_s: float, mean_prompt: float,
          mean_output: float, decode_node: str | None = None, min_unc: int = 0, itl_target_s: float = _INF,
          no_decode: frozenset[str] = frozenset()) -> tuple[tuple[float, str, str] | None, tuple[_Node, int, _Node, int, float] | None]:
    """The pair search as a pass over the nodes (a small fleet, and the reference the index's
    vector form is tested against): each leg's PAIR_WIDTH best rows, then every pair of them.
    Returns the best pair's key (score, prefill id, decode id) and (p, its cache, d, its cache,
    transfer seconds)."""
    decs: list[tuple[float, float, _Node, int]] = []
    pres: list[tuple[float, float, _Node, int]] = []
    for v in nodes:
        st = v.state
        if not st.kv_group or v.node_id in exclude:
            continue
        reason = is_routable(v, model, now, stale_after_s)
        roles = st.roles
        can_decode = (reason is None and (not roles or "decode" in roles) and decode_node in (None, v.node_id)
                      and v.node_id not in no_decode)
        can_prefill = (reason is None or reason == "prefill_only") and (not roles or "prefill" in roles)
        if not (can_decode or can_prefill):
            continue
        n = w if v is whole else _Node(v, mean_prompt, mean_output)
        c = cached.get(v.node_id, 0)
        if can_decode and prompt - c >= min_unc:
            # the decode leg's part: its queue, its one-token prefill, its tokens
            t = n.wait_prefill + 1.0 / n.pf + (out_tokens - 1) * n.step_next
            decs.append((t, n.cost / 3600.0 * (out_tokens - 1) * n.step_next / n.maxc, n, c))
        if can_prefill:
            pre = max(prompt - c, 1) / n.pf
            pres.append((n.wait_prefill + pre * (1 + n.decoding), n.cost / 3600.0 * pre, n, c))
    best_key: tuple[float, str, str] | None = None
    best_pair: tuple[_Node, int, _Node, int, float] | None = None
    kvb = settings.kv_bytes_per_token
    explicit = links.explicit
    cost_obj = objective == "cost"
    drows = [(d, cd, d.v.state, d.v.node_id, d.wait_prefill + 1.0 / d.pf, (out_tokens - 1) * d.step_next,
              d.cost / 3600.0 * (out_tokens - 1) * d.step_next / d.maxc,
              _itl_late(out_tokens, d.step_next, itl_target_s))
             for _, _, d, cd in _best(decs, cost_obj)]
    for _, _, p, cp in _best(pres, cost_obj):
        pst = p.v.state
        pid = p.v.node_id
        pre = max(prompt - cp, 1) / p.pf
        head = p.wait_prefill + pre
        stall = pre * p.decoding
        pdollars = p.cost / 3600.0 * pre
        for d, cd, dst, did, dhead, drest, ddollars, dlate in drows:
            if d is p or not pst.kv_group or pst.kv_group != dst.kv_group:
                continue
            gbps = explicit.get((pid, did)) if explicit else None
            if gbps is None:
                ends = [g for g in (pst.kv_gbps, dst.kv_gbps) if g > 0]
                if not ends:
                    continue
                gbps = min(ends)
            xfer = max(prompt - cd, 0) * kvb / (gbps * _GBIT)
            ttft = head + xfer + dhead
            time_s = ttft + drest + stall
            if cost_obj:
                score = _score(objective, ttft, time_s, pdollars + ddollars, latency_target_s, dlate)
            else:
                score = time_s + LATE_WEIGHT * (ttft - latency_target_s) if ttft > latency_target_s else time_s
                if dlate:
                    score += LATE_WEIGHT * dlate
            key = (score, pid, did)
            if best_key is None or key < best_key:
                best_key, best_pair = key, (p, cp, d, cd, xfer)
    return best_key, best_pair


def _best(rows: list[tuple[float, float, _Node, int]], by_cost: bool) -> list[tuple[float, float, _Node, int]]:
    """The PAIR_WIDTH best rows by time and, for the cost objective, the PAIR_WIDTH best by
    dollars too (each objective's own part of the score)."""
    if len(rows) <= PAIR_WIDTH:
        return rows
    by_time = heapq.nsmallest(PAIR_WIDTH, rows, key=lambda r: (r[0], r[2].v.node_id))
    if not by_cost:
        return by_time
    cheapest = heapq.nsmallest(PAIR_WIDTH, rows, key=lambda r: (r[1], r[2].v.node_id))
    seen = {id(r[2]) for r in by_time}
    return by_time + [r for r in cheapest if id(r[2]) not in seen]


def objective_of(strategy: str, cost_priority: str | None) -> Objective:
    """The decider's objective for a policy: cost strategies (and a chain whose cost_priority
    is cost) minimise dollars within the TTFT target; every other one, time.

    >>> objective_of("cost", None), objective_of("balanced", "cost"), objective_of("latency", None)
    ('cost', 'cost', 'latency')
    """
    return "cost" if strategy == "cost" or cost_priority == "cost" else "latency"
