"""Session affinity that yields: keep a conversation on its node while that node is within a
load bound, let the policy choose otherwise. Pure: the binding is an input, time is passed in.

A session (the OpenAI ``user`` field, an ``x-session-id`` header / ``Zml-Session`` on NATS, the
SDK's ``session=``) is bound to the node that served it last; the caller keeps the bindings
(a NATS KV bucket with an idle TTL, shared by every replica) and passes the bound node as
``RouteRequest.session_node``. :func:`keep_bound` says whether it stays:

* **moved**: the bound node cannot take the request (down, stale, cooling down, saturated,
  excluded, not serving the model, outside the policy's chain): the policy chooses, the caller
  rebinds. A dead node's sessions move this way on their next request.
* **spilled**: the bound node is over its bound: the policy chooses, the caller rebinds.
* **kept**: otherwise.

The bound is *consistent hashing with bounded loads* (Mirrokni, Thorup and Zadimoghaddam,
SODA 2018, the rule behind SGLang's and vLLM's bounded sticky routing) made heterogeneous:
a node may hold at most ``ceil(SESSION_LOAD_BOUND x (L + 1) x mu_n / M)`` requests with this
one, where ``L`` is the requests on every node that could take it, ``mu_n`` the node's capacity
(req/s at full batch) and ``M`` theirs together. Its share of the load is in proportion to its
capacity, so an Inferentia2 bound session spills long before an H100 one would at the same
queue depth, and the ceiling leaves every node room for one request on an idle fleet. 1.25 is
the issue's bound (SGLang uses 1.5); it trades cache hits for balance and rarely matters,
because the cache-aware estimate already keeps a conversation where its prefix is.
"""

from __future__ import annotations

import math

import numpy as np

from zmlcore.policy.context import Ctx, VCtx
from zmlcore.policy.estimate import INF

#: A session's node may carry this multiple of its capacity-proportional share of the load.
SESSION_LOAD_BOUND = 1.25


def keep_bound(ctx: Ctx, node_id: str, bound: float = SESSION_LOAD_BOUND) -> tuple[int | None, str]:
    """(row of the bound node, "kept"), or (None, "moved" / "spilled")."""
    t = ctx.table
    j = ctx.fleet.where(node_id, t)
    if j is None or t.key[j] == INF or ctx.ranks[t.fam[j]] < 0 or not ctx.ok(j):
        return None, "moved"
    depth, drain = t.depth, t.drain
    if isinstance(ctx, VCtx):
        d = ctx.drains()
        if ctx.chain.outside_rows is not None:  # (drains() masks them already; kept explicit)
            d = np.where(ctx.chain.outside_rows, INF, d)
        live = d != INF
        load = float(depth[live].sum())
        cap = float(((depth[live] + 1.0) / d[live]).sum())
    else:
        load = cap = 0.0
        ranks, fam = ctx.ranks, t.fam
        for i in range(len(t.views)):
            if drain[i] != INF and ranks[fam[i]] >= 0 and ctx.ok(i):
                load += depth[i]
                cap += (depth[i] + 1.0) / drain[i]
    mu = (float(depth[j]) + 1.0) / float(drain[j])
    allowed = math.ceil(bound * (load + 1.0) * mu / cap - 1e-9) if cap > 0 else 1
    return (j, "kept") if float(depth[j]) + 1.0 <= allowed else (None, "spilled")
