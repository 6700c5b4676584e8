"""Token-fair shares between tenants: a virtual token counter with decay, merged across router
replicas (pure: time is passed in).

Each tenant (an API key, a NATS identity) is charged what its requests cost the fleet in
weighted tokens: prompt tokens at ``prefill_cost`` and output tokens at ``decode_cost`` (VTC,
"Fairness in Serving Large Language Models", OSDI'24, weighs them 1 and 2). The saturation queue
serves first the tenant with the least service per unit of weight (least attained service), so
backlogged tenants get the fleet in proportion to their weights, counted in tokens rather than
requests. Counters decay with a half-life: a tenant idle for a while is not owed a burst of
banked credit, and one that flooded a minute ago is not punished for ever.

Across replicas: each replica counts what it dispatched and publishes its counters (a
:class:`~zmlcore.messages.flow.ShareReport`, the replica's own entry: no write conflicts); a
tenant's service is its counter here plus every peer's last report, decayed to now. N replicas
then order by the same numbers, off by at most one report interval of a peer's charges.

    book = ShareBook("r1", half_life_s=30.0)
    book.charge("acme", book.cost(prompt_tokens=800, output_tokens=200), now)
    book.merge(peer_report, now)
    book.service("acme", weight=2.0, now=now)   # weighted tokens per unit of weight, decayed
"""

from __future__ import annotations

import math

from zmlcore.flowctl.bands import NAMES
from zmlcore.messages.flow import ShareReport

#: Counters below this many weighted tokens are dropped from reports (and forgotten).
NEGLIGIBLE = 0.5
_BAND = {name: i for i, name in enumerate(NAMES)}
#: A peer's report older than this many half-lives adds nothing worth keeping.
FORGET_HALF_LIVES = 8.0


class ShareBook:
    """One replica's view of every tenant's recent service. Mutated only by its event loop."""

    __slots__ = ("replica", "half_life_s", "k", "prefill_cost", "decode_cost", "own", "peers", "version",
                 "own_waiting", "own_bands", "own_backlog")

    def __init__(self, replica: str, *, half_life_s: float = 30.0, prefill_cost: float = 1.0,
                 decode_cost: float = 2.0) -> None:
        self.replica = replica
        self.half_life_s = half_life_s
        self.k = math.log(2.0) / half_life_s
        self.prefill_cost = prefill_cost
        self.decode_cost = decode_cost
        #: tenant -> [weighted tokens as of t, t]
        self.own: dict[str, list[float]] = {}
        #: replica -> its latest report
        self.peers: dict[str, ShareReport] = {}
        #: Charges made here so far: a publisher reports when it moved.
        self.version = 0
        #: tenant -> its requests this replica holds waiting in the saturation queue
        self.own_waiting: dict[str, int] = {}
        #: band name -> its requests this replica holds waiting
        self.own_bands: dict[str, int] = {}
        #: band name -> tenant -> its requests of that band this replica holds waiting
        self.own_backlog: dict[str, dict[str, int]] = {}

    def cost(self, prompt_tokens: float, output_tokens: float) -> float:
        """Weighted tokens of a request (its prompt prefilled, its output decoded)."""
        return self.prefill_cost * max(0.0, prompt_tokens) + self.decode_cost * max(0.0, output_tokens)

    def _decay(self, value: float, at: float, now: float) -> float:
        return value * math.exp(-self.k * (now - at)) if now > at else value

    def charge(self, tenant: str, amount: float, now: float) -> None:
        """Add ``amount`` weighted tokens (negative: a correction once the real output is known)
        to ``tenant``'s counter here."""
        self.version += 1
        entry = self.own.get(tenant)
        if entry is None:
            self.own[tenant] = [max(0.0, amount), now]
            return
        entry[0] = max(0.0, self._decay(entry[0], entry[1], now) + amount)
        entry[1] = now

    def tokens(self, tenant: str, now: float) -> float:
        """``tenant``'s weighted tokens, decayed to ``now``, here and at every peer."""
        total = 0.0
        entry = self.own.get(tenant)
        if entry is not None:
            total = self._decay(entry[0], entry[1], now)
        for rep in self.peers.values():
            v = rep.tenants.get(tenant)
            if v:
                total += self._decay(v, rep.at, now)
        return total

    def service(self, tenant: str, weight: float, now: float) -> float:
        """What ``tenant`` has been served lately per unit of its weight: the queue serves the
        lowest first."""
        return self.tokens(tenant, now) / (weight if weight > 0 else 1.0)

    def fair_level(self, now: float, weights: dict[str, float] | None = None) -> float:
        """The service per unit of weight every tenant would have if the recent tokens had been
        shared by weight among the tenants that used any: a tenant above it is over its share."""
        names = set(self.own)
        for rep in self.peers.values():
            names.update(rep.tenants)
        ws = weights or {}
        total = sum_w = 0.0
        for t in names:
            tok = self.tokens(t, now)
            if tok >= NEGLIGIBLE:
                total += tok
                sum_w += ws.get(t, 1.0)
        return total / sum_w if sum_w > 0 else 0.0

    def share_used(self, tenant: str, weight: float, now: float, weights: dict[str, float] | None = None) -> float:
        """``tenant``'s share of every tenant's recent tokens, as a multiple of its fair share
        (1.0: exactly its weight's share; above: more). ``weights``: other tenants' weights
        (default 1 each). 0 when nothing was served lately."""
        names = set(self.own)
        for rep in self.peers.values():
            names.update(rep.tenants)
        names.add(tenant)
        ws = weights or {}
        total = sum_w = 0.0
        for t in names:
            tok = self.tokens(t, now)
            if tok < NEGLIGIBLE and t != tenant:
                continue
            total += tok
            sum_w += weight if t == tenant else ws.get(t, 1.0)
        if total <= 0.0 or sum_w <= 0.0:
            return 0.0
        return (self.tokens(tenant, now) / total) / (weight / sum_w)

    def set_waiting(self, waiting: dict[str, int], bands: dict[str, int] | None = None,
                    backlog: dict[str, dict[str, int]] | None = None) -> None:
        """The tenants' requests this replica holds in the saturation queue now, the same by
        band name, and by band name and tenant (reported with the counters when they changed)."""
        bands = bands if bands is not None else self.own_bands
        backlog = backlog if backlog is not None else self.own_backlog
        if waiting != self.own_waiting or bands != self.own_bands or backlog != self.own_backlog:
            self.own_waiting, self.own_bands = dict(waiting), dict(bands)
            self.own_backlog = {b: dict(ts) for b, ts in backlog.items()}
            self.version += 1

    def waiting(self, tenant: str, band: int | None = None) -> int:
        """``tenant``'s requests waiting in the saturation queue, held here or by a peer (as of
        its last report): its backlog, whichever replica's window holds it; with ``band``, its
        backlog in that band only.

        >>> b = ShareBook("r1"); b.set_waiting({"flood": 3}, backlog={"standard": {"flood": 3}})
        >>> b.merge(ShareReport(replica="r2", at=0.0, waiting={"flood": 30}, backlog={"standard": {"flood": 29},
        ...                                                                            "critical": {"flood": 1}}), 0.0)
        >>> b.waiting("flood"), b.waiting("steady"), b.waiting("flood", band=1), b.waiting("flood", band=0)
        (33, 0, 32, 1)
        """
        if band is not None:
            name = NAMES[band]
            n = self.own_backlog.get(name, {}).get(tenant, 0)
            for rep in self.peers.values():
                n += rep.backlog.get(name, {}).get(tenant, 0)
            return n
        n = self.own_waiting.get(tenant, 0)
        for rep in self.peers.values():
            n += rep.waiting.get(tenant, 0)
        return n

    def waiting_elsewhere(self) -> dict[tuple[str, int], int]:
        """(tenant, band) -> its requests of that band the peers hold waiting (their last reports)."""
        out: dict[tuple[str, int], int] = {}
        for rep in self.peers.values():
            for name, ts in rep.backlog.items():
                band = _BAND.get(name)
                if band is None:
                    continue
                for t, n in ts.items():
                    out[(t, band)] = out.get((t, band), 0) + n
        return out

    def gone(self, replica: str) -> None:
        """``replica`` fell silent (the router's peer table dropped it: killed): what it held
        waiting is no longer its (JetStream hands those entries to the others, who count them
        as their own), so its backlog counts go; the tokens it served stay, decaying as usual.
        Kept, its last report made a tenant look backlogged twice over (over its share) for
        minutes.

        >>> b = ShareBook("r1"); b.merge(ShareReport(replica="r2", at=0.0, tenants={"t": 9.0}, waiting={"t": 5}), 0.0)
        >>> b.gone("r2"); b.waiting("t"), b.tokens("t", 0.0)
        (0, 9.0)
        """
        rep = self.peers.get(replica)
        if rep is not None and (rep.waiting or rep.bands or rep.backlog):
            self.peers[replica] = ShareReport(replica=rep.replica, at=rep.at, tenants=rep.tenants)

    def report(self, now: float) -> ShareReport:
        """This replica's counters, decayed to ``now``; negligible ones forgotten."""
        out: dict[str, float] = {}
        for tenant, (v, at) in list(self.own.items()):
            d = self._decay(v, at, now)
            if d < NEGLIGIBLE:
                del self.own[tenant]
            else:
                out[tenant] = round(d, 1)
        return ShareReport(replica=self.replica, at=now, tenants=out,
                           waiting={t: n for t, n in self.own_waiting.items() if n > 0},
                           bands={b: n for b, n in self.own_bands.items() if n > 0},
                           backlog={b: {t: n for t, n in ts.items() if n > 0} for b, ts in self.own_backlog.items()
                                    if any(ts.values())})

    def merge(self, report: ShareReport, now: float) -> None:
        """Take a peer's report (a newer one replaces its older one; our own is ignored)."""
        if report.replica == self.replica:
            return
        old = self.peers.get(report.replica)
        if old is None or report.at >= old.at:
            self.peers[report.replica] = report
        horizon = FORGET_HALF_LIVES * self.half_life_s
        for name in [r for r, rep in self.peers.items() if now - rep.at > horizon]:
            del self.peers[name]
