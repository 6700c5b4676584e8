"""SplitIndex: the split decider's per-node terms in columns, kept exact per change, so a
decision over a large fleet is a few vector operations instead of a pass over the nodes.

:func:`~zmlcore.policy.split.decide_split` scores every node of a ``kv_group`` as a possible
prefill leg (its queue, the prompt at its prefill speed, the stall it imposes on its decoding
sequences) and as a possible decode leg (its queue, its decode step); only the pair's transfer
couples the two. Over a thousand nodes a Python pass costs milliseconds. This index keeps:

* per node, the terms that depend on its state alone (speeds, price, ``1/pf``, the decode
  leg's head ``wait + 1/pf``, ...), recomputed when its :class:`~zmlcore.policy.NodeView`
  changes (O(1), as :class:`~zmlcore.policy.FleetIndex` does);
* per model, which rows may take each leg (up, serving it, role), kept row by row as states
  change rather than rebuilt per request.

Per decision it computes each leg's keys with the decider's own formulas, in the same order
of floating-point operations (so the values are the Python pass's, bit for bit), selects the
best :data:`~zmlcore.policy.split.decide.PAIR_WIDTH` rows of each leg (ties broken by node id,
as the pass does: rows are kept in node-id order) and scores their pairs in one matrix.
``tests/unit/test_split_decide.py`` compares its decisions with the pass's on random fleets.

    index = SplitIndex(views)                     # once per membership change, watching the views
    decide_split(views, whole, ..., index=index)  # the same decision, its candidates from the index
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, node_speeds
from zmlcore.messages import NodeState
from zmlcore.policy.types import NodeView

_INF = float("inf")
_GBIT = 1e9 / 8.0


class SplitIndex:
    """Columns of the nodes, in node-id order. A node is a possible leg while its state has a
    ``kv_group`` and ``member(state)`` holds (the router's: an engine with a leg protocol);
    both are read again at each state change, so the index is built once per membership
    change of the fleet, not when a node joins a group."""

    def __init__(self, nodes: Sequence[NodeView], *, mean_prompt: float = MEAN_PROMPT_TOKENS,
                 mean_output: float = MEAN_OUTPUT_TOKENS, member: Callable[[NodeState], bool] | None = None) -> None:
        self.views = sorted(nodes, key=lambda v: v.node_id)
        self._member = member
        self.row = {v.node_id: j for j, v in enumerate(self.views)}
        self.mean_prompt = mean_prompt
        self.mean_output = mean_output
        n = len(self.views)
        z = np.zeros
        self.pf, self.inv_pf, self.dec, self.maxc, self.cost, self.cost_h = z(n), z(n), z(n), z(n), z(n), z(n)
        self.gbps, self.group = z(n), z(n, np.int64)
        self.can_p, self.can_d, self.usable = z(n, bool), z(n, bool), z(n, bool)
        self.wait, self.dhead, self.decoding, self.dec1, self.step_next = z(n), z(n), z(n), z(n), z(n)
        self.blocked, self.updated = z(n), z(n)
        self._groups: dict[str, int] = {}
        #: model -> (rows serving it, rows that may prefill it, rows that may decode it), kept
        #: row by row on structural changes (a state poll) once a decision asked for the model
        self._models: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        #: an upper bound of ``blocked`` and a lower bound of ``updated``: a decision skips the
        #: cooldown and staleness passes when no node can be cooling or stale
        self._blocked_max = 0.0
        self._updated_min = _INF
        for j, v in enumerate(self.views):
            self._static(j, v)
            self._counts(j, v)
            v._watchers.append(self)

    def close(self) -> None:
        for v in self.views:
            if self in v._watchers:
                v._watchers.remove(self)

    # --- upkeep (NodeView watcher protocol) ---
    def _node_changed(self, view: NodeView, structural: bool) -> None:
        j = self.row.get(view.node_id)
        if j is None:
            return
        if structural:
            self._static(j, view)
            models = view.state.models
            for m, (serving, pen_p, pen_d) in self._models.items():
                s = serving[j] = m in models
                pen_p[j] = 0.0 if s and self.usable[j] and self.can_p[j] else _INF
                pen_d[j] = 0.0 if s and self.usable[j] and self.can_d[j] else _INF
        self._counts(j, view)

    def _counts_changed(self, view: NodeView) -> None:
        j = self.row.get(view.node_id)
        if j is not None:
            self._counts(j, view)

    def _static(self, j: int, v: NodeView) -> None:
        st = v.state
        pf, dec, maxc = node_speeds(st)
        self.pf[j], self.inv_pf[j], self.dec[j], self.maxc[j] = pf, 1.0 / pf, dec, maxc
        self.cost[j] = st.cost_per_hour
        self.cost_h[j] = st.cost_per_hour / 3600.0
        self.gbps[j] = st.kv_gbps
        self.group[j] = self._groups.setdefault(st.kv_group, len(self._groups))
        roles = st.roles
        self.can_p[j] = not roles or "prefill" in roles
        self.can_d[j] = not roles or "decode" in roles
        # up, in a kv_group, and a member: a possible leg at all
        self.usable[j] = st.status == "up" and bool(st.kv_group) and (self._member is None or self._member(st))
        self.updated[j] = st.updated_at
        if st.updated_at < self._updated_min:
            self._updated_min = st.updated_at

    def _counts(self, j: int, v: NodeView) -> None:
        # the same terms as decide._Node, from the view's effective counters
        pf, dec, maxc = float(self.pf[j]), float(self.dec[j]), int(self.maxc[j])
        out = v.effective_outstanding()
        pending = v.effective_pending()
        tokens = v.effective_pending_tokens(self.mean_prompt)
        ahead = (pending * self.mean_prompt if tokens is None else tokens) / pf
        q = out + 1 - maxc
        full_step = (1.0 + DECODE_BATCH_PENALTY * (maxc - 1)) / dec
        slot_wait = q * max(self.mean_output - 1.0, 0.0) * full_step / maxc if q > 0 else 0.0
        wait = ahead + slot_wait
        self.wait[j] = wait
        self.dhead[j] = wait + 1.0 / pf
        decoding = max(0, min(out, maxc) - pending)
        self.decoding[j] = decoding
        self.dec1[j] = 1 + decoding
        b = min(out + 1, maxc)
        self.step_next[j] = (1.0 + DECODE_BATCH_PENALTY * (b - 1)) / dec
        cool, sat = v.cooldown_until, v.saturated_until
        blocked = cool if cool > sat else sat
        self.blocked[j] = blocked
        if blocked > self._blocked_max:
            self._blocked_max = blocked

    def _legs(self, model: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows serving ``model``; 0 where a row may prefill it, else inf; the same for decode):
        adding the penalty to a key keeps it bit for bit or rules the row out."""
        m = self._models.get(model)
        if m is None:
            serving = np.array([model in v.state.models for v in self.views], dtype=bool)
            m = self._models[model] = (serving, np.where(serving & self.usable & self.can_p, 0.0, _INF),
                                       np.where(serving & self.usable & self.can_d, 0.0, _INF))
        return m

    # --- a decision ---
    def best_pair(self, model: str, prompt: int, out_tokens: int, cached: Mapping[str, int], min_uncached: int,
                  exclude: frozenset[str], now: float, stale_after_s: float, width: int, cost_objective: bool,
                  kv_bytes_per_token: float, explicit: Mapping[tuple[str, str], float], target_s: float,
                  late_weight: float, late_dollars_per_s: float, decode_node: str | None = None,
                  itl_target_s: float = _INF, no_decode: frozenset[str] = frozenset()
                  ) -> tuple[int, int, float, float] | None:
        """(prefill row, decode row, transfer seconds, score) of the best pair among each leg's
        best ``width`` rows by time and, for the cost objective, by dollars too; None if no pair.
        The decider's own formulas (decide.decide_split's scan), as vector operations."""
        n = len(self.views)
        if not n or prompt < min_uncached:  # (the caller returned short_prompt already then)
            return None
        _, pen_p, pen_d = self._legs(model)
        # each leg's keys, one row each: prefill time, decode time (, prefill dollars, decode dollars)
        K = np.empty((4 if cost_objective else 2, n))
        # the prefill leg's tokens: the prompt less each node's cached prefix
        pre = float(max(prompt, 1)) / self.pf
        short: list[int] = []
        if cached:
            for node_id, c in cached.items():
                j = self.row.get(node_id)
                if j is not None and c:
                    pre[j] = max(prompt - c, 1) / float(self.pf[j])
                    if prompt - c < min_uncached:
                        short.append(j)
        k0, k1 = K[0], K[1]
        np.multiply(pre, self.dec1, out=k0)  # wait + pre x (1 + decoding)
        k0 += self.wait
        k0 += pen_p
        rest = (out_tokens - 1) * self.step_next
        np.add(self.dhead, rest, out=k1)  # wait + 1/pf + (O-1) x step
        k1 += pen_d
        if cost_objective:
            k2, k3 = K[2], K[3]
            np.multiply(self.cost_h, pre, out=k2)
            k2 += pen_p
            np.multiply(self.cost_h, float(out_tokens - 1), out=k3)
            k3 *= self.step_next
            k3 /= self.maxc
            k3 += pen_d
        if short:
            K[1::2, short] = _INF  # (decode keys only: its cache leaves too little to prefill)
        gone = [j for j in (self.row.get(i) for i in exclude) if j is not None] if exclude else []
        if self._blocked_max > now:  # (cooling or saturated nodes are rare: skip the pass)
            self._blocked_max = float(self.blocked.max())
            if self._blocked_max > now:
                gone += np.flatnonzero(self.blocked > now).tolist()
        if self._updated_min < now - stale_after_s:  # (likewise stale states)
            self._updated_min = float(self.updated.min())
            if self._updated_min < now - stale_after_s:
                gone += np.flatnonzero((now - self.updated) > stale_after_s).tolist()
        if gone:
            K[:, gone] = _INF
        if no_decode:  # (they may still prefill)
            nod = [j for j in (self.row.get(i) for i in no_decode) if j is not None]
            if nod:
                K[1::2, nod] = _INF
        if decode_node is not None:  # that node or none decodes
            keep = self.row.get(decode_node)
            kept = K[1::2, keep].copy() if keep is not None else None
            K[1::2] = _INF
            if keep is not None:
                K[1::2, keep] = kept
        # each key's best `width` rows: argmin takes the first of equal values, the lowest row,
        # which is the lowest node id (the pass's tie-break)
        picked: list[set[int]] = [set(), set()]
        ar = np.arange(len(K))
        for _ in range(min(width, n)):
            idx = K.argmin(axis=1)
            vals = K[ar, idx]
            for r, (j, v) in enumerate(zip(idx.tolist(), vals.tolist())):
                if v < _INF:
                    picked[r & 1].add(j)
            K[ar, idx] = _INF
        if not picked[0] or not picked[1]:
            return None
        prows, drows = sorted(picked[0]), sorted(picked[1])
        P = np.array(prows)
        D = np.array(drows)
        pre_p = pre[P]
        head = self.wait[P] + pre_p
        stall = pre_p * self.decoding[P]
        # the decode leg pulls what its own cache lacks
        moved = np.full(len(D), float(max(prompt, 0)))
        if cached:
            for k, j in enumerate(drows):
                c = cached.get(self.views[j].node_id, 0)
                if c:
                    moved[k] = max(prompt - c, 0)
        valid = (self.group[P][:, None] == self.group[D][None, :]) & (P[:, None] != D[None, :])
        gp, gd = self.gbps[P], self.gbps[D]
        gbps = np.minimum.outer(np.where(gp > 0, gp, _INF), np.where(gd > 0, gd, _INF))
        if explicit:
            for a, pj in enumerate(prows):
                pid = self.views[pj].node_id
                for b, dj in enumerate(drows):
                    g = explicit.get((pid, self.views[dj].node_id))
                    if g is not None:
                        gbps[a, b] = g
        valid &= gbps < _INF
        with np.errstate(divide="ignore", invalid="ignore"):
            xfer = (moved * kv_bytes_per_token)[None, :] / (gbps * _GBIT)
        ttft = (head[:, None] + xfer) + self.dhead[D][None, :]
        time_s = (ttft + rest[D][None, :]) + stall[:, None]
        step = self.step_next[D]
        # each decode leg's seconds past the inter-token target: (O-1) x the excess of each step
        late = np.where(step > itl_target_s, (out_tokens - 1) * (step - itl_target_s), 0.0)
        if cost_objective:
            dollars = (self.cost_h[P] * pre_p)[:, None] + (self.cost_h[D] * float(out_tokens - 1) * step
                                                         / self.maxc[D])[None, :]
            score = np.where((ttft <= target_s) & (late == 0.0)[None, :], dollars, late_dollars_per_s * time_s)
        else:
            score = np.where(ttft > target_s, time_s + late_weight * (ttft - target_s), time_s)
            score += (late_weight * late)[None, :]  # (+ 0.0 where within it: the same value)
        score = np.where(valid, score, _INF)
        k = int(np.argmin(score))  # first minimum: the lowest (prefill id, decode id), rows in id order
        a, b = divmod(k, len(drows))
        best = float(score[a, b])
        if best == _INF:
            if not valid.any():
                return None
            a, b = divmod(int(np.argmax(valid)), len(drows))  # (only infinite scores: the first valid pair)
        return prows[a], drows[b], float(xfer[a, b]), best

