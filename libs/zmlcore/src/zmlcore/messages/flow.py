"""Flow control between router replicas (``zmlcore.flowctl``).

- :class:`ShareReport` on ``zml.flow.shares``: one replica's decayed token counters per tenant
  (what each tenant cost it lately, in weighted tokens), so that every replica orders its
  saturation queue by the same shares: N replicas act as one fair scheduler.
"""

from __future__ import annotations

import msgspec


class ShareReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A replica's counters as of ``at`` (unix s): tenant -> weighted tokens, decayed to ``at``
    with the configured half-life. A newer report from the same replica replaces an older one."""

    replica: str
    at: float
    tenants: dict[str, float] = {}
    #: tenant -> its requests this replica holds waiting in the saturation queue (a tenant's
    #: backlog is every replica's: each holds a window of the queue)
    waiting: dict[str, int] = {}
    #: band name -> its requests this replica holds waiting (the dashboard's flow panel)
    bands: dict[str, int] = {}
    #: band name -> tenant -> its requests of that band this replica holds waiting: a tenant's
    #: backlog within a band (fair shares are within a band: zmlcore.flowctl.gate.standing)
    backlog: dict[str, dict[str, int]] = {}


share_report_decoder = msgspec.json.Decoder(ShareReport)
