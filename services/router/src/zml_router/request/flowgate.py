"""Flow control on the request path (zmlcore.flowctl, docs/routing.md "Flow control"): what a
request asks (band, tenant, targets), its decision through the gate, its tenant charged in the
fair share, the node's TPOT learned from its reply. The decisions are zmlcore.flowctl's; this
module holds the router's state for them (its ShareBook, merged with the other replicas' by
zml_router.replicas.shares; its TPOT calibration) and the per-request record the reply reads.

A plain request (no band, no target, nothing in the config that would give it one) costs a
header lookup or two here and takes today's path unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.errors import QueueFullError, ShedError
from zmlcore.flowctl import SHEDDABLE, Ask, Calibration, Pairs, ShareBook, SloVerdict, ask_of
from zmlcore.flowctl.ask import ASK_HEADERS, config_plain
from zmlcore.flowctl.bands import NAMES
from zmlcore.flowctl.gate import (SpareSplit, admit_flow, no_room, outranks, over_share, standing, takes_spare_only,
                                  unseen_by_peers)
from zmlcore.flowctl.slo import batch_of, model_tpot, predict_tpot
from zmlcore.messages import RoutingInfo
from zmlcore.policy import Decision, ResolvedPolicy, RouteRequest, RoutingState
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS
from zmlcore.policy.prefix import PrefixIndex

from zmlcore.telemetry import tracing

from zml_router.replicas.table import NodeTable
from zml_router.telemetry import tracing as rtrace


_P, _TTFT, _TPOT, _DEFAULT = ASK_HEADERS
#: How long another replica's send may take to reach this one's table: its in-flight delta is
#: summed for 2 ms (zml_router.replicas.deltas), then crosses the broker into a busy event loop.
UNSEEN_S = 0.02


def tenant_of(subject: str, owner: str, headers: Mapping[str, str] | None) -> str:
    """Whom a request's share is counted for: a queued request keeps the tenant it arrived with;
    from a front door (the gateway), the API key (``Zml-Owner``: the key id, or the client
    address without keys); on ``zml.infer``, the sender's identity (its own ``Zml-Owner`` would
    let it split itself into many tenants)."""
    h = headers or {}
    queued = h.get(subjects.H_TENANT)
    if queued:
        return queued
    if subject == subjects.FRONT_DOOR_INFER:
        return "key:" + (h.get(subjects.H_OWNER) or owner)
    return "id:" + owner


@dataclass(slots=True)
class Note:
    """One request's flow control, for its reply's routing metadata and its completion."""

    ask: Ask
    asked: str = ""  # the band it asked for when lowered
    verdict: SloVerdict | None = None
    share_used: float | None = None
    queued_ms: int | None = None
    charged: float = 0.0
    node_id: str = ""
    batch: int = 0
    slots: int = 0
    model_tpot: float = 0.0
    #: it uses spare capacity only (its tenant over its share, ``sheddable``, a higher band
    #: waiting): zmlcore.flowctl.gate.takes_spare_only
    yields: bool = False
    #: the node it runs on as work that takes spare capacity only (counted in this replica's part
    #: of the spare slots until it ends: FlowGate.ended)
    spare_on: str = ""

    def fill(self, info: RoutingInfo) -> None:
        """The reply's flow-control fields (docs/http-api.md "Routing metadata")."""
        a = self.ask
        info.priority = a.band_name
        info.priority_lowered_from = self.asked
        info.share_used = None if self.share_used is None else round(self.share_used, 3)
        info.queued_ms = self.queued_ms
        if a.slo is not None:
            info.ttft_slo_ms = None if a.slo.ttft_s is None else round(a.slo.ttft_s * 1000, 1)
            info.tpot_slo_ms = None if a.slo.tpot_s is None else round(a.slo.tpot_s * 1000, 1)
            if self.verdict is not None:
                info.predicted_ttft_ms = round(self.verdict.ttft_s * 1000, 1)
                info.predicted_tpot_ms = round(self.verdict.tpot_s * 1000, 2)
                info.slo = "admitted"


def targets(note: Note | None) -> tuple[float | None, float | None]:
    """The request's (time-to-first-token, time-per-output-token) targets, its SLO (None: none)."""
    slo = note.ask.slo if note is not None else None
    return (slo.ttft_s, slo.tpot_s) if slo is not None else (None, None)


class FlowGate:
    def __init__(self, cfg: ZMLConfig, table: NodeTable, state: RoutingState, prefix: PrefixIndex,
                 router_id: str) -> None:
        f = cfg.flow
        self.cfg = cfg
        self.table = table
        self.state = state
        self.prefix = prefix
        self.book = ShareBook(router_id, half_life_s=f.share_half_life_s, prefill_cost=f.prefill_token_cost,
                              decode_cost=f.decode_token_cost)
        self.calibration = Calibration()
        #: Nothing in the config makes a request other than plain: only its own headers can.
        self.config_plain = config_plain(f, cfg.models) and not f.hold_when_full
        #: node id -> when this replica sent it requests under [flow] hold_when_full, the last
        #: UNSEEN_S (the other replicas' sends in that time may not be counted here yet)
        self._sent: dict[str, deque[tuple[float, bool]]] = {}
        #: Called when capacity may have freed (the saturation queue's entries are tried again):
        #: a slot counted as another replica's unseen send is free again once UNSEEN_S passes.
        self.freed: Callable[[], None] = lambda: None
        #: node id -> when another replica's request on it ended, the last UNSEEN_S (that replica
        #: refills the slot from its own queue window, and its send reaches here a delta later)
        self._peer_freed: dict[str, deque[float]] = {}
        #: model -> (the best (band, over-share) waiting for it, the other replicas holding
        #: queued work for it): the saturation queue's announcements, once it has started
        self.waiting: Callable[[str], tuple[tuple[int, int] | None, dict[str, int]]] = lambda model: (None, {})
        #: node id -> this replica's requests running there that take spare capacity only
        self._spare_own: dict[str, int] = {}
        self.router_id = router_id

    def note(self, subject: str, owner: str, headers: Mapping[str, str] | None, model: str) -> Note | None:
        """The request's flow control, or None for a plain request (today's path)."""
        if self.config_plain and (not headers or (_P not in headers and _TTFT not in headers
                                                  and _TPOT not in headers and _DEFAULT not in headers)):
            return None  # four dict lookups: the plain path's whole cost here
        h = headers or {}
        ask = ask_of(h, tenant=tenant_of(subject, owner, h), flow=self.cfg.flow, model=self.cfg.models.get(model))
        asked = ""
        if ask.lowered:
            asked = h.get(subjects.H_PRIORITY, "").strip().lower()
        if ask.plain and not self.cfg.flow.hold_when_full and not asked:
            return None
        return Note(ask, asked if asked in NAMES else "")

    def decide(self, rr: RouteRequest, policy: ResolvedPolicy, note: Note, from_queue: bool,
               pairs: Pairs | None = None, *, ahead: int = 0) -> Decision:
        """The gate's decision (zmlcore.flowctl.gate.admit_flow) on this router's table. A
        ``sheddable`` request that finds no room is shed at once rather than queued. ``pairs``:
        the request may be split (zml_router.request.split.Splitter.pairs): with targets no whole
        node meets, it is admitted split over a pair that meets them, if one does. ``ahead``: a
        queued request's entries ranked before it in its holder's window (with a backlog ahead,
        any free slot will do)."""
        now = time.time()
        ask = note.ask
        used, over = standing(self.book, ask.tenant, ask.weight, now, ask.band)
        note.share_used = used
        rc = self.cfg.router
        waiting, holders = self.waiting(rr.model)
        note.yields = takes_spare_only(ask.band, over, waiting)
        try:
            d, verdict = admit_flow(self.table.nodes(), rr, policy, now, self.state, ask,
                                    over_share=over, flow=self.cfg.flow,
                                    stale_after_s=rc.stale_after_s, ttft_bound_s=rc.admission_ttft_s,
                                    reserve=rc.batch_reserve, cache=self.prefix, calibration=self.calibration,
                                    ahead=ahead,
                                    unseen=self._unseen(note.yields) if self._sent or self._peer_freed else None,
                                    pairs=pairs, waiting=waiting,
                                    split=SpareSplit(self.router_id, self._spare_own, holders)
                                    if note.yields and self.cfg.flow.hold_when_full else None)
        except QueueFullError as exc:
            if ask.band >= SHEDDABLE and not from_queue and ask.band != 3:
                raise ShedError(f"no room for sheddable work now: {exc.message}",
                                routing_context={**(exc.routing_context or {}), "final_error": "shed",
                                                 "priority": ask.band_name},
                                retry_after=exc.retry_after or 1.0) from None
            raise
        note.verdict = verdict
        if tracing.ON:
            rtrace.flow(ask.band_name, ask.tenant, used, verdict.ttft_s if verdict else None,
                        verdict.tpot_s if verdict else None)
        view = self.table.views.get(d.node_id)
        if view is not None and ask.slo is not None:
            note.node_id = d.node_id
            note.batch, note.slots = batch_of(view, rr.model)
            note.model_tpot = model_tpot(view, rr.model)
        return d

    def outranks(self, note: Note, best: tuple[int, int] | None) -> bool:
        """Does the request rank before everything waiting (``best``: the best (band,
        over-share) waiting)? zmlcore.flowctl.gate.outranks, as the flow simulator asks it."""
        ask = note.ask
        return outranks(ask.band, ask.tenant, ask.weight, self.book, time.time(), best)

    def redirected(self, note: Note | None, d: Decision, model: str) -> None:
        """The split decider moved the request's decode to ``d.node_id`` (zml_router.request.split):
        its verdict is the split's, and its measured TPOT teaches that node's calibration, not
        the node admission chose."""
        if note is None or note.ask.slo is None or not note.node_id or d.node_id == note.node_id:
            return
        view = self.table.views.get(d.node_id)
        if view is None:
            return
        note.node_id = d.node_id
        note.batch, note.slots = batch_of(view, model)
        note.model_tpot = model_tpot(view, model)
        note.verdict = SloVerdict(d.estimated_ttft_s, predict_tpot(view, self.calibration, model))

    def sent(self, node_id: str, note: Note) -> None:
        """A request under [flow] hold_when_full goes to ``node_id`` (each attempt): for the
        free-slot test of this replica's next ones (:meth:`_unseen`)."""
        if not self.cfg.flow.hold_when_full:
            return
        if note.yields and not note.spare_on:
            note.spare_on = node_id
            self._spare_own[node_id] = self._spare_own.get(node_id, 0) + 1
        if not self.table.peers:
            return
        q = self._sent.get(node_id)
        if q is None:
            q = self._sent[node_id] = deque()
        q.append((time.monotonic(), note.yields))
        asyncio.get_running_loop().call_later(UNSEEN_S, self.freed)

    def ended(self, note: Note) -> None:
        """The request's attempt ended (answered, failed or handed back): its slot is no longer
        in this replica's part of the spare slots."""
        node_id, note.spare_on = note.spare_on, ""
        if node_id:
            n = self._spare_own.get(node_id, 0) - 1
            if n > 0:
                self._spare_own[node_id] = n
            else:
                self._spare_own.pop(node_id, None)

    def peer_freed(self, node_id: str, n: int) -> None:
        """Another replica's ``n`` requests on ``node_id`` ended (its delta): those slots stay
        its for UNSEEN_S, since it refills them from its own queue window at once and that send
        reaches here a delta later. Taken here too, a freed slot was filled twice: on a 4-slot
        node with a flood held to 3 of them, 4 ran half the time and a steady tenant waited for
        the 4th (tests/e2e/test_flow_control.py)."""
        if not self.cfg.flow.hold_when_full:
            return
        q = self._peer_freed.get(node_id)
        if q is None:
            q = self._peer_freed[node_id] = deque()
        now = time.monotonic()
        q.extend([now] * n)
        asyncio.get_running_loop().call_later(UNSEEN_S, self.freed)

    def peers_gone(self, router_ids: list[str]) -> None:
        """Replicas the peer table dropped (silent past its TTL: killed): their backlog counts
        go (zmlcore.flowctl.shares.ShareBook.gone); what they held comes back to the survivors."""
        for router_id in router_ids:
            self.book.gone(router_id)

    def _unseen(self, yields: bool) -> dict[str, int]:
        """Per node, what the other replicas may have sent it that has not reached this table
        yet: as many as this replica sent it in the last UNSEEN_S, per peer
        (zmlcore.flowctl.gate.unseen_by_peers), and the slots they freed in that time. Sends of
        work that takes spare capacity only (a tenant over its share, ``sheddable``) count only
        for a request that ``yields`` too: they left the reserve the others may take (counted
        for all, a steady tenant's request waited ~20 ms after each of a flood's sends, i.e.
        nearly always)."""
        if not self.table.peers:
            return {}
        horizon = time.monotonic() - UNSEEN_S
        recent: dict[str, int] = {}
        for node_id, q in list(self._sent.items()):
            while q and q[0][0] < horizon:
                q.popleft()
            if q:
                recent[node_id] = sum(1 for _, y in q if yields or not y)
            else:
                del self._sent[node_id]
        out = unseen_by_peers(recent, len(self.table.peers))
        for node_id, freed in list(self._peer_freed.items()):
            while freed and freed[0] < horizon:
                freed.popleft()
            if freed:
                out[node_id] = out.get(node_id, 0) + len(freed)
            else:
                del self._peer_freed[node_id]
        return out

    def no_room(self, note: Note | None, model: str) -> frozenset[str]:
        """Nodes without a slot for this request (zmlcore.flowctl.gate.no_room): a split's legs
        keep off them as the request's own decision did (none without ``hold_when_full``)."""
        if note is None or not self.cfg.flow.hold_when_full:
            return frozenset()
        ask = note.ask
        waiting, holders = self.waiting(model)
        return no_room(self.table.nodes(), ask, flow=self.cfg.flow,
                       over_share=over_share(note.share_used or 0.0, self.book.waiting(ask.tenant, ask.band)),
                       unseen=self._unseen(note.yields) if self._sent or self._peer_freed else None,
                       waiting=waiting, split=SpareSplit(self.router_id, self._spare_own, holders))

    def dispatched(self, note: Note, prompt_tokens: int) -> None:
        """Charge the tenant at dispatch: its prompt and a mean output (corrected at the end)."""
        note.charged = self.book.cost(prompt_tokens, MEAN_OUTPUT_TOKENS)
        self.book.charge(note.ask.tenant, note.charged, time.time())

    def finished(self, note: Note, completion_tokens: int, ttft_s: float | None, total_s: float) -> None:
        """The request ended: the tenant's charge corrected with its real output; with a first
        token and an output, the node's TPOT learned (zmlcore.flowctl.slo.Calibration)."""
        if note.charged:
            fix = self.book.decode_cost * (completion_tokens - MEAN_OUTPUT_TOKENS)
            self.book.charge(note.ask.tenant, fix, time.time())
        if note.node_id and ttft_s is not None and completion_tokens > 1 and note.model_tpot > 0:
            actual = (total_s - ttft_s) / (completion_tokens - 1)
            if actual > 0:
                self.calibration.observe(note.node_id, note.batch, note.slots, predicted=note.model_tpot,
                                         actual=actual)
