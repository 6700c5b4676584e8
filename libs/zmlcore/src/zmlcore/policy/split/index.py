"""SplitIndex: the split decider's per-node terms in columns, kept exact per change, so a
decision over a large fleet picks each leg's candidates in a few vector operations.

:func:`~zmlcore.policy.split.decide_split` scores every node of a ``kv_group`` as a possible
prefill leg (its queue, the prompt at its prefill speed, the stall it imposes on its decoding
sequences) and as a possible decode leg (its queue, its decode step); only the pair's transfer
couples the two. Over a thousand nodes a Python pass costs milliseconds; this index keeps each
node's terms in numpy columns, recomputed when its :class:`~zmlcore.policy.NodeView` changes
(O(1), as :class:`~zmlcore.policy.FleetIndex` does), and per decision selects the best
:data:`~zmlcore.policy.split.decide.PAIR_WIDTH` rows of each leg by time and by dollars. The
pair search then runs on those rows, in the decider's own code: the answer is the Python pass's.

    index = SplitIndex(views)                     # once per membership change, watching the views
    decide_split(views, whole, ..., index=index)  # the same decision, its candidates from the index
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY
from zmlcore.policy.estimate import MEAN_OUTPUT_TOKENS, MEAN_PROMPT_TOKENS, node_speeds
from zmlcore.policy.types import NodeView

_INF = np.inf


class SplitIndex:
    """Columns of every node that belongs to a ``kv_group`` (the others are never a leg)."""

    def __init__(self, nodes: Sequence[NodeView], *, mean_prompt: float = MEAN_PROMPT_TOKENS,
                 mean_output: float = MEAN_OUTPUT_TOKENS) -> None:
        self.views = [v for v in nodes if v.state.kv_group]
        self.row = {v.node_id: j for j, v in enumerate(self.views)}
        self.mean_prompt = mean_prompt
        self.mean_output = mean_output
        n = len(self.views)
        z = np.zeros
        self.pf, self.inv_pf, self.dec, self.maxc, self.cost = z(n), z(n), z(n), z(n), z(n)
        self.can_p, self.can_d, self.up = z(n, bool), z(n, bool), z(n, bool)
        self.wait, self.decoding, self.step_next = z(n), z(n), z(n)
        self.blocked, self.updated = z(n), z(n)
        #: model -> rows serving it (rebuilt lazily when a node's models change)
        self._models: dict[str, np.ndarray] = {}
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
            self._models.clear()
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
        roles = st.roles
        self.can_p[j] = not roles or "prefill" in roles
        self.can_d[j] = not roles or "decode" in roles
        self.up[j] = st.status == "up"
        self.updated[j] = st.updated_at

    def _counts(self, j: int, v: NodeView) -> None:
        # the same terms as decide._Node, from the view's effective counters
        pf, dec, maxc = self.pf[j], self.dec[j], int(self.maxc[j])
        out = v.effective_outstanding()
        pending = v.effective_pending()
        tokens = v.effective_pending_tokens(self.mean_prompt)
        ahead = (pending * self.mean_prompt if tokens is None else tokens) / pf
        q = out + 1 - maxc
        full_step = (1.0 + DECODE_BATCH_PENALTY * (maxc - 1)) / dec
        slot_wait = q * max(self.mean_output - 1.0, 0.0) * full_step / maxc if q > 0 else 0.0
        self.wait[j] = ahead + slot_wait
        self.decoding[j] = max(0, min(out, maxc) - pending)
        b = min(out + 1, maxc)
        self.step_next[j] = (1.0 + DECODE_BATCH_PENALTY * (b - 1)) / dec
        cool, sat = v.cooldown_until, v.saturated_until
        self.blocked[j] = cool if cool > sat else sat

    def _serving(self, model: str) -> np.ndarray:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = np.array([model in v.state.models for v in self.views], dtype=bool)
        return m

    # --- a decision ---
    def candidates(self, model: str, prompt: int, out_tokens: int, cached: Mapping[str, int], min_uncached: int,
                   exclude: frozenset[str], now: float, stale_after_s: float, width: int
                   ) -> tuple[list[int], list[int]]:
        """Rows of the best ``width`` prefill legs and decode legs, each by time and by dollars."""
        if not self.views:
            return [], []
        ok = self.up & self._serving(model) & (self.blocked <= now) & (self.updated >= now - stale_after_s)
        for node_id in exclude:
            j = self.row.get(node_id)
            if j is not None:
                ok[j] = False
        unc = np.full(len(self.views), float(prompt))
        for node_id, c in cached.items():
            j = self.row.get(node_id)
            if j is not None:
                unc[j] = prompt - c
        pre = np.maximum(unc, 1.0) * self.inv_pf
        pm = ok & self.can_p
        dm = ok & self.can_d & (unc >= min_uncached)
        p_time = np.where(pm, self.wait + pre * (1.0 + self.decoding), _INF)
        p_cost = np.where(pm, self.cost * pre, _INF)
        rest = (out_tokens - 1) * self.step_next
        d_time = np.where(dm, self.wait + self.inv_pf + rest, _INF)
        d_cost = np.where(dm, self.cost * rest / self.maxc, _INF)
        return _top(p_time, p_cost, width), _top(d_time, d_cost, width)


def _top(by_time: np.ndarray, by_cost: np.ndarray, width: int) -> list[int]:
    rows: list[int] = []
    for col in (by_time, by_cost):
        k = min(width, len(col))
        idx = np.argpartition(col, k - 1)[:k] if len(col) > k else np.arange(len(col))
        for j in idx[np.argsort(col[idx], kind="stable")].tolist():
            if col[j] < _INF and j not in rows:
                rows.append(j)
    return rows
