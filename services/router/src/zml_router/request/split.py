"""Whether a request is split into a prefill leg and a decode leg, on this router's table.

The decision itself is :func:`zmlcore.policy.split.decide_split` (pure, shared with the
routing simulator); this module gives it the router's inputs: the nodes whose engine has a
leg protocol here (``zml_router.node.legs.SPLIT_BACKENDS``), the policy's objective and
latency target, the link table of zml.toml and the conversation's last mode (hysteresis, so a
conversation's turns do not flip between modes on noise).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from zmlcore.config import ZMLConfig
from zmlcore.flowctl import Pairs
from zmlcore.messages import NodeState
from zmlcore.policy import Decision, NodeView, ResolvedPolicy, RouteRequest
from zmlcore.policy.split import KVLinks, Option, SplitIndex, SplitSettings, decide_split, objective_of
from zmlcore.policy.split.decide import Mode

from zml_router.node.legs import SPLIT_BACKENDS
from zml_router.replicas.table import NodeTable

#: Conversations whose last mode is remembered (least recently used forgotten first).
MAX_SESSIONS = 100_000
#: Above this many nodes the legs' candidates come from a SplitIndex (numpy columns kept per
#: change) rather than a pass over the nodes.
INDEX_ABOVE = 16
#: Seconds after which a small fleet's candidates are listed again though no node came or went.
REFRESH_S = 5.0


def _has_legs(st: NodeState) -> bool:
    """The node's engine has a leg protocol here."""
    return st.backend in SPLIT_BACKENDS


class Splitter:
    def __init__(self, cfg: ZMLConfig, table: NodeTable) -> None:
        self.cfg = cfg
        self.table = table
        self.enabled = cfg.disaggregation.enabled
        self.links = KVLinks.from_config(cfg.kv_links)
        d = cfg.disaggregation
        self._settings: dict[str, SplitSettings] = {}
        self._default = SplitSettings(d.min_uncached_tokens, d.min_gain, float(d.kv_bytes_per_token), d.always)
        self.modes: OrderedDict[str, Mode] = OrderedDict()
        #: the table's node list the candidates and index were made from (rebuilt when it changes)
        self._src: object = None
        self._nodes: list[NodeView] = []
        self._index: SplitIndex | None = None
        self._nodes_src: object = None
        self._built_at = 0.0

    def _candidates(self, now: float) -> tuple[list[NodeView], SplitIndex | None]:
        src = self.table.nodes()  # a new list whenever the membership changes
        if src is not self._src:
            if self._index is not None:
                self._index.close()
            self._src = src
            # a large fleet: an index over every node, following each one's kv_group and engine
            # as its state changes (built once per membership change: ~4 ms at 1,000 nodes)
            self._index = SplitIndex(src, member=_has_legs) if len(src) > INDEX_ABOVE else None
        if self._index is not None:
            return self._nodes, self._index
        if now - self._built_at > REFRESH_S or self._nodes_src is not src:
            # a small fleet: the nodes with a leg protocol, listed again when it changes and
            # every REFRESH_S (a node's kv_group or engine may change in its state alone)
            self._built_at, self._nodes_src = now, src
            self._nodes = [v for v in src if v.state.kv_group and _has_legs(v.state)]
        return self._nodes, None

    def settings(self, model: str) -> SplitSettings:
        s = self._settings.get(model)
        if s is None:
            mc = self.cfg.models.get(model)
            s = self._default
            if mc is not None and mc.kv_bytes_per_token is not None:
                s = dataclasses.replace(s, kv_bytes_per_token=float(mc.kv_bytes_per_token))
            self._settings[model] = s
        return s

    def pairs(self, model: str, now: float) -> Pairs:
        """The decider's inputs for SLO admission (zmlcore.flowctl.slo.admit_slo), which looks
        for a pair before refusing a request no whole node serves within its targets."""
        nodes, index = self._candidates(now)
        return Pairs(index.views if index is not None else nodes, self.settings(model), self.links, index)

    def admitted(self, session: str) -> None:
        """SLO admission split the request (no whole node met its targets): its conversation's
        mode is split, as if the decider had chosen it."""
        self._remember(session, "split")

    def _remember(self, session: str, mode: Mode) -> None:
        if session:
            self.modes[session] = mode
            self.modes.move_to_end(session)
            if len(self.modes) > MAX_SESSIONS:
                self.modes.popitem(last=False)

    def decide(self, whole: Decision, rr: RouteRequest, policy: ResolvedPolicy, now: float,
               session: str = "", decode_node: str | None = None,
               no_room: frozenset[str] = frozenset(), tpot_target_s: float | None = None,
               ttft_target_s: float | None = None) -> tuple[Decision, str]:
        """The decision to act on (``whole``, or a split one naming its prefill node) and the
        reason (zmlcore.policy.split.SplitDecision.reason). ``decode_node``: only that node may
        decode (``whole`` is on it: a split whose prefill leg failed, looking for another).

        Each leg takes a slot of its node like any request, and is admitted like one: no leg on
        the nodes flow control keeps this request off (``no_room``: zml_router.request.flowgate,
        under ``[flow] hold_when_full``; the node the request's own decision admitted it to
        excepted), on a saturated or cooling node (the decider's routability), nor a split whose
        estimated time to first token is over ``[router] admission_ttft_s`` (reason
        ``over_bound``), nor one estimated to miss a target of the request's that whole is
        estimated to meet (reason ``slo``: it was admitted whole on them).

        ``tpot_target_s``: the request's time-per-output-token target (its SLO), if any: a
        decode past it counts as late (zmlcore.policy.split.decide_split's ``itl_target_s``),
        and a short prompt whose node decodes too slowly for it may be split too.
        ``ttft_target_s``: its time-to-first-token target, if any, instead of the policy's
        ``latency_target_ms``."""
        views = self.table.views
        view = views.get(whole.node_id)
        if view is None or not view.state.kv_group or view.state.backend not in SPLIT_BACKENDS:
            return whole, "no_pair"
        nodes, index = self._candidates(now)
        cfg = policy.config
        target = ttft_target_s if ttft_target_s is not None else (cfg.latency_target_ms or 2000.0) / 1000.0
        previous = self.modes.get(session) if session else None
        barred = no_room - {whole.node_id}
        exclude = rr.exclude | barred if barred else rr.exclude
        sd = decide_split(nodes, view, model=rr.model, prompt_tokens=rr.prompt_tokens, output_tokens=rr.max_tokens,
                          cached={whole.node_id: whole.cached_tokens}, settings=self.settings(rr.model),
                          links=self.links, now=now, objective=objective_of(policy.strategy, cfg.cost_priority),
                          latency_target_s=target, previous=previous, exclude=exclude,
                          itl_target_s=tpot_target_s if tpot_target_s is not None else float("inf"),
                          stale_after_s=self.cfg.router.stale_after_s, index=index, decode_node=decode_node)
        if sd.split and sd.chosen is not None and sd.chosen.ttft_s > self.cfg.router.admission_ttft_s:
            # the admission bound, as for any request: whole was admitted under it, the split is not
            sd = dataclasses.replace(sd, split=False, reason="over_bound", chosen=sd.whole)
        if (sd.split and sd.chosen is not None and sd.whole is not None and decode_node is None
                and (ttft_target_s is not None or tpot_target_s is not None)
                and _within(sd.whole, ttft_target_s, tpot_target_s)
                and not _within(sd.chosen, ttft_target_s, tpot_target_s)):
            # the request was admitted whole on its targets: a split estimated to miss one that
            # whole is estimated to meet would break that promise, whatever it saves elsewhere
            sd = dataclasses.replace(sd, split=False, reason="slo", chosen=sd.whole)
        if sd.reason != "short_prompt":
            self._remember(session, sd.mode)
        if not sd.split or sd.chosen is None:
            return whole, sd.reason
        c = sd.chosen
        dv = views[c.node]
        return dataclasses.replace(whole, node_id=c.node, family=dv.state.family, prefill_node=c.prefill_node,
                                   queue_depth=dv.effective_outstanding(), transfer_tokens=c.transfer_tokens,
                                   transfer_s=c.transfer_s, cached_tokens=0, estimated_ttft_s=c.ttft_s), sd.reason


def _within(o: Option, ttft_s: float | None, tpot_s: float | None) -> bool:
    """The option is estimated within the request's targets (None: no target of that kind)."""
    return (ttft_s is None or o.ttft_s <= ttft_s) and (tpot_s is None or o.itl_s <= tpot_s)
