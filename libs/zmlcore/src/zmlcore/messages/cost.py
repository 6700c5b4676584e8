"""Run-time cost entries (KV bucket ``zml_costs``, key = node id)."""

from __future__ import annotations

import msgspec


class CostEntry(msgspec.Struct, kw_only=True):
    """A node's price, overriding zml.toml's ``cost_per_hour`` until deleted."""

    cost_per_hour: float
    #: Who set it: "manual", "spot:<provider>", ...
    source: str = "manual"
    updated_at: float = 0.0


cost_entry_decoder = msgspec.json.Decoder(CostEntry)
