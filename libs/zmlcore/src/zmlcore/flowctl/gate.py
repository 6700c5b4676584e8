"""The router's decision for a request under flow control: which node, or wait, or refuse.
Pure: no I/O, ``now`` is passed in; the router and the flow simulator (benches/flow_sim.py) call it.

    decision, verdict = admit_flow(nodes, rr, policy, now, state, ask, over_share=False, flow=cfg.flow,
                                   stale_after_s=15.0, ttft_bound_s=60.0, reserve=0.1)

- ``batch``: only where a node has headroom beyond ``reserve`` (zmlcore.policy.headroom), as today;
- with ``[flow] hold_when_full``: when the node the policy prefers (its estimate counts the wait
  for a slot there) has no free sequence slot, the request waits in the saturation queue
  (QUEUE_FULL here) for one, where the queue's order (zmlcore.flowctl.order) lets higher bands
  and tenants under their share go first; it does not take a slower node's free slot the policy
  did not prefer, unless others wait before it (then it takes any free slot). A tenant over
  its fair share in its band, a ``sheddable`` request, and any request while a higher band's
  work waits use spare capacity only (:func:`takes_spare_only`): any node with more than
  ``[flow] spare_reserve`` of its slots free, so that the next request of an under-share tenant,
  or of a higher band, finds a slot at once instead of waiting for one; and only within this
  replica's part of those spare slots (:func:`spare_part`);
- a request with latency targets: zmlcore.flowctl.slo.admit_slo (the pick that meets them, a
  split over a pair that does when no whole node does and the request may be split, or
  SLO_UNATTAINABLE at once);
- anything else: zmlcore.policy.admission.admit, exactly as without flow control.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from zmlcore.config import FlowConfig
from zmlcore.errors import ModelNotLoadedError, NoHealthyNodesError, QueueFullError
from zmlcore.flowctl.ask import Ask
from zmlcore.flowctl.bands import BATCH, SHEDDABLE
from zmlcore.flowctl.order import BACKLOG
from zmlcore.flowctl.shares import ShareBook
from zmlcore.flowctl.slo import Calibration, Pairs, SloVerdict, admit_slo
from zmlcore.policy import admission
from zmlcore.policy.choose import is_routable
from zmlcore.policy.estimate import node_speeds
from zmlcore.policy.headroom import admit_batch, reserved_slots
from zmlcore.policy.prefix import PrefixIndex
from zmlcore.policy.resolve import ResolvedPolicy
from zmlcore.policy.types import Decision, NodeView, RouteRequest, RoutingState

#: Retry-After of "no free slot": one frees within a request's decode, usually far sooner.
NO_SLOT_RETRY_S = 0.2
def over_share(share_used: float, queued: int) -> bool:
    """Is a tenant over its share, for the gate (it then uses spare capacity only)? Above its fair
    share of the recent tokens *and* with a backlog of its own waiting. The backlog matters:
    tenants at their share wander +/-15-20% around it, and judged by the share alone half of
    them would leave the reserve idle at any time (p99 TTFT x3 at 90% load in
    benches/flow_sim.py); a flood held back to spare capacity hovers near its share too (it
    takes what is left), but always has work waiting. A lone tenant is never over (its share is 1).

    >>> over_share(1.4, queued=30), over_share(1.4, queued=0), over_share(0.9, queued=30)
    (True, False, False)
    """
    return share_used > 1.0 and queued >= BACKLOG  # the queue's order uses the same two tests


def standing(book: ShareBook, tenant: str, weight: float, now: float, band: int | None = None) -> tuple[float, bool]:
    """``tenant``'s share used (zmlcore.flowctl.shares.ShareBook.share_used) and whether it is
    over its share (:func:`over_share`, its backlog counted over every replica's window): with
    ``band``, its backlog in that band, since fair shares are within a band. A tenant flooding
    ``standard`` is not over its share in ``critical``: its critical request is not held to
    spare capacity (nor ranked behind the band's other tenants) by its own lower-band backlog.

    >>> b = ShareBook("r1"); b.charge("x", 900.0, 0.0); b.charge("y", 100.0, 0.0)
    >>> b.set_waiting({"x": 10}, backlog={"standard": {"x": 10}})
    >>> standing(b, "x", 1.0, 0.0, band=1)[1], standing(b, "x", 1.0, 0.0, band=0)[1]
    (True, False)
    """
    used = book.share_used(tenant, weight, now)
    return used, over_share(used, book.waiting(tenant, band))


def outranks(band: int, tenant: str, weight: float, book: ShareBook, now: float,
             best: tuple[int, int] | None) -> bool:
    """Does a new request rank before everything waiting in the saturation queue (``best``: the
    best (band, over-share) waiting, announced by the replicas holding it; None: nothing)? A
    higher band, or its tenant under its share while only over-share work waits: it then takes
    a free slot at once instead of a trip through the queue to the head it would reach anyway.

    >>> b = ShareBook("r1")
    >>> outranks(0, "t", 1.0, b, 0.0, (1, 0)), outranks(1, "t", 1.0, b, 0.0, (1, 0)), outranks(1, "t", 1.0, b, 0.0, (1, 1))
    (True, False, True)
    """
    if best is None:
        return False
    return (band, int(standing(book, tenant, weight, now, band)[1])) < best


def takes_spare_only(band: int, over: bool, waiting: tuple[int, int] | None = None) -> bool:
    """Does a request use spare capacity only, leaving ``[flow] spare_reserve`` of each node's
    slots free? When its tenant is over its share (within its band: :func:`standing`), when it
    is ``sheddable``, and when work of a higher band waits (``waiting``: the best (band,
    over-share) waiting for its model, the replicas' announcements): the reserve is then that
    band's, for its next request (a higher band's over-share work leaves it too, and a
    ``standard`` request took it while ``critical`` work waited, a turnover longer).

    >>> takes_spare_only(1, False), takes_spare_only(1, True), takes_spare_only(2, False)
    (False, True, True)
    >>> takes_spare_only(1, False, waiting=(0, 1)), takes_spare_only(0, False, waiting=(1, 1)), takes_spare_only(1, False, (1, 0))
    (True, False, False)
    """
    return over or band >= SHEDDABLE or (waiting is not None and waiting[0] < band)


def spare_part(spare: int, me: str, held: Mapping[str, int]) -> int:
    """Replica ``me``'s part of a node's ``spare`` slots (those beyond the reserve) for work that
    takes spare capacity only, shared with the other replicas holding queued work for the same
    model (``held``: replica -> entries it holds, ``me`` included): one each, the rest in
    proportion to what each holds (largest remainder; ties by id), so that every window drains
    and the largest drains fastest. With more holders than spare slots, the largest holders
    get one each. Each replica admits such work against its own requests in flight there,
    which it knows exactly, not against the shared counts, which arrive a delta late: two
    replicas woken by the same freed slot each saw a spare slot and both filled it, the reserve
    with it (tests/e2e/test_flow_control.py: a steady tenant then waited for the next slot to
    free, a whole request of the flood's when its slots freed in step).

    >>> spare_part(3, "r1", {"r1": 1, "r2": 38}), spare_part(3, "r2", {"r1": 1, "r2": 38})
    (1, 2)
    >>> spare_part(3, "r1", {"r1": 5}), spare_part(6, "r1", {"r1": 10, "r2": 10}), spare_part(1, "r2", {"r1": 4, "r2": 5})
    (3, 3, 1)
    """
    holders = {r: max(1, n) for r, n in held.items()}
    holders[me] = max(1, holders.get(me, 1))
    if len(holders) == 1:
        return spare
    by_size = sorted(holders, key=lambda r: (-holders[r], r))
    if spare <= len(holders):
        return 1 if me in by_size[:spare] else 0
    rest = spare - len(holders)
    total = sum(holders.values())
    exact = {r: rest * n / total for r, n in holders.items()}
    part = {r: int(x) for r, x in exact.items()}
    left = rest - sum(part.values())
    for r in sorted(holders, key=lambda r: (-(exact[r] - part[r]), -holders[r], r))[:left]:
        part[r] += 1
    return 1 + part[me]


@dataclasses.dataclass(frozen=True, slots=True)
class SpareSplit:
    """How a replica shares the nodes' spare slots with the others (:func:`spare_part`)."""

    #: this replica's id
    me: str
    #: node id -> this replica's requests running there that take spare capacity only
    own: Mapping[str, int]
    #: replica -> entries of the model it holds in the saturation queue (this one's and the
    #: others' announced); empty: none holds any, the spare slots are this replica's
    held: Mapping[str, int] = dataclasses.field(default_factory=dict)


def free_slots(view: NodeView) -> int:
    """Sequence slots of the node nobody holds (the router's counts plus what its poll saw)."""
    _, _, maxc = node_speeds(view.state)
    return maxc - view.effective_outstanding()


def full_nodes(nodes: Sequence[NodeView], keep: float, unseen: Mapping[str, int] | None = None,
               split: SpareSplit | None = None) -> frozenset[str]:
    """Nodes that would have fewer than ``reserved_slots(maxc, keep)`` slots free after one more
    request (``keep`` 0: nodes with no free slot), counted in the routers' own in-flight
    requests (every replica's, shared). Not the poll's: what it saw beyond them was measured a
    poll earlier, and under churn it holds a slot or two that have freed since (on a 4-slot node
    a steady tenant waited ~1 s per request beside a flood, tests/e2e/test_flow_control.py).
    Traffic that bypasses the routers still counts in the TTFT estimate.

    ``unseen``: node id -> requests the other replicas may have sent it that their shared counts
    have not brought here yet (:func:`unseen_by_peers`), counted as taken. ``split`` (with
    ``keep``): also full where this replica's own such requests fill its part of the spare
    slots (:func:`spare_part`)."""
    out = []
    for v in nodes:
        maxc = node_speeds(v.state)[2]
        seen = unseen.get(v.node_id, 0) if unseen else 0
        kept = reserved_slots(maxc, keep) if keep > 0 else 0
        if v.outstanding + 1 + seen + kept > maxc:
            out.append(v.node_id)
        elif kept and split is not None and split.own.get(v.node_id, 0) + 1 > spare_part(maxc - kept, split.me,
                                                                                          split.held):
            out.append(v.node_id)
    return frozenset(out)


def unseen_by_peers(own_recent: Mapping[str, int], peers: int) -> dict[str, int]:
    """What the other replicas may have sent each node within the time their counts take to
    arrive here, estimated from this replica's own sends in that time (``own_recent``: node id ->
    requests this replica sent it then): replicas take requests from one queue group, so a burst
    reaches each about equally, and each sees the others' sends only once their deltas arrive.
    Without it, a burst that reaches two replicas at once is admitted by each to every free slot
    (8 requests sent to a node of 4 slots, 4 of them in the engine's own queue, where no band can
    overtake them: tests/e2e/test_flow_control.py). Alone (``peers`` 0) there is nothing unseen.

    >>> unseen_by_peers({"a": 2, "b": 0}, peers=1), unseen_by_peers({"a": 2}, peers=0)
    ({'a': 2}, {})
    """
    if peers <= 0:
        return {}
    return {node: n * peers for node, n in own_recent.items() if n > 0}


def no_room(nodes: Sequence[NodeView], ask: Ask, *, over_share: bool, flow: FlowConfig,
            unseen: Mapping[str, int] | None = None, waiting: tuple[int, int] | None = None,
            split: SpareSplit | None = None) -> frozenset[str]:
    """Nodes with no slot for ``ask`` under ``[flow] hold_when_full`` (none without it): no free
    slot, or for work that takes spare capacity only (:func:`takes_spare_only`: its tenant over
    its share, ``sheddable``, a higher band waiting) none beyond ``spare_reserve`` (and this
    replica's part of those: ``split``).
    :func:`admit_flow` keeps a request off them; a split request's legs (zmlcore.policy.split)
    keep off them too, each leg taking a slot of its node like any request.

    >>> from zmlcore.config import FlowConfig
    >>> from zmlcore.flowctl.ask import Ask
    >>> from zmlcore.messages import NodeState
    >>> v = NodeView(NodeState(node_id="n", accelerator_type="cpu", family="CPU", endpoint="", status="up",
    ...                        models=["m"], max_concurrency=4), outstanding=3)
    >>> sorted(no_room([v], Ask(band=1, lowered=False, tenant="t", weight=1.0, slo=None), over_share=False, flow=FlowConfig(hold_when_full=True)))
    []
    >>> sorted(no_room([v], Ask(band=1, lowered=False, tenant="t", weight=1.0, slo=None), over_share=True, flow=FlowConfig(hold_when_full=True)))
    ['n']
    """
    if not flow.hold_when_full:
        return frozenset()
    yields = takes_spare_only(ask.band, over_share, waiting)
    return full_nodes(nodes, flow.spare_reserve if yields else 0.0, unseen, split if yields else None)


def admit_flow(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float, state: RoutingState,
               ask: Ask, *, over_share: bool, flow: FlowConfig, stale_after_s: float, ttft_bound_s: float,
               reserve: float, cache: PrefixIndex | None = None, calibration: Calibration | None = None,
               ahead: int = 0, unseen: Mapping[str, int] | None = None,
               pairs: Pairs | None = None, waiting: tuple[int, int] | None = None,
               split: SpareSplit | None = None) -> tuple[Decision, SloVerdict | None]:
    """The decision (and SLO verdict, when the request has targets) for ``ask``; QueueFullError
    when it must wait, SloUnattainableError when no node can meet its targets. ``ahead``:
    requests waiting in the saturation queue before this one (a backlog: any free slot is taken).
    ``unseen``: per node, sends of the other replicas not counted here yet (:func:`unseen_by_peers`).
    ``pairs``: the request may be split (zmlcore.flowctl.slo.admit_slo's last resort); its legs
    keep off the nodes without room for it. ``waiting``: the best (band, over-share) waiting for
    the model (a higher band's: this request takes spare capacity only). ``split``: this
    replica's part of the spare slots, for work that takes spare capacity only."""
    if ask.band == BATCH:
        return admit_batch(nodes, rr, policy, now, state, stale_after_s=stale_after_s, reserve=reserve), None
    full: frozenset[str] = frozenset()
    hold = flow.hold_when_full and rr.accelerator_id is None
    if hold:
        yields = takes_spare_only(ask.band, over_share, waiting)
        full = no_room(nodes, ask, over_share=over_share, flow=flow, unseen=unseen, waiting=waiting,
                       split=split) - rr.exclude
        if full and yields:  # spare capacity only: any node with room beyond the reserve
            rr = dataclasses.replace(rr, exclude=rr.exclude | full)
        if full and pairs is not None:  # no leg where the request itself could not go
            pairs = dataclasses.replace(pairs, exclude=pairs.exclude | full)
    try:
        d, v = _decide(nodes, rr, policy, now, state, ask, stale_after_s, ttft_bound_s, cache, calibration, pairs)
        if d.node_id not in full:
            return d, v
        if ahead == 0:
            # The node the policy prefers (its estimate counts the wait for one slot there) has
            # none free and nothing waits before this request: wait for it rather than take a
            # worse node's free slot.
            raise _no_slot(rr.model, policy.name, f"the best node for it ({d.node_id}) has no free sequence slot")
        # A backlog waits already: each waits for far more than one slot there; take a free one.
        rr = dataclasses.replace(rr, exclude=rr.exclude | full)
        return _decide(nodes, rr, policy, now, state, ask, stale_after_s, ttft_bound_s, cache, calibration, pairs)
    except (NoHealthyNodesError, ModelNotLoadedError):
        busy = [v.node_id for v in nodes if v.node_id in full and is_routable(v, rr.model, now, stale_after_s) is None]
        if not busy:
            raise
        raise _no_slot(rr.model, policy.name, f"every node with room is taken ({len(busy)} busy)") from None


def _decide(nodes: Sequence[NodeView], rr: RouteRequest, policy: ResolvedPolicy, now: float, state: RoutingState,
            ask: Ask, stale_after_s: float, ttft_bound_s: float, cache: PrefixIndex | None,
            calibration: Calibration | None, pairs: Pairs | None = None) -> tuple[Decision, SloVerdict | None]:
    if ask.slo is not None:
        return admit_slo(nodes, rr, policy, now, state, ask.slo, stale_after_s=stale_after_s,
                         ttft_bound_s=ttft_bound_s, cache=cache, calibration=calibration, pairs=pairs)
    return admission.admit(nodes, rr, policy, now, state, stale_after_s=stale_after_s, ttft_bound_s=ttft_bound_s,
                           cache=cache), None


def _no_slot(model: str, policy: str, why: str) -> QueueFullError:
    return QueueFullError(
        f"{why}: the request for {model!r} waits for the next free slot in the saturation queue",
        routing_context={"policy": policy, "final_error": "no_free_slot",
                         "recommendation": "enable queue_on_saturation on the policy, or retry shortly"},
        retry_after=NO_SLOT_RETRY_S,
    )
