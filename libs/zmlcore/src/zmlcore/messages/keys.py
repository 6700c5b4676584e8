"""API keys with plans (KV bucket ``zml_keys``) and their shared usage (``zml_limits``)."""

from __future__ import annotations

import msgspec


class PlanLimits(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A plan's numbers. None: no limit of that kind."""

    requests_per_minute: int | None = None
    concurrent: int | None = None
    tokens_per_minute: int | None = None


class ApiKeyRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One API key as stored: its SHA-256 (hex), never the key itself."""

    id: str
    sha256: str
    name: str = ""
    plan: str = "custom"
    limits: PlanLimits = PlanLimits()
    #: Models this key may use (canonical names or aliases); empty: all.
    models: list[str] = []
    #: Policy applied when a request names none.
    default_policy: str = ""
    #: Cost-attribution label: in routing metadata (``zml.label``) and completion events.
    label: str = ""
    created_at: float = 0.0
    #: Flow control (docs/routing.md "Flow control"): the band of requests that name none, the
    #: highest band they may claim ("": [flow] default_priority / max_priority), and the key's
    #: weight in the fair share between tenants.
    priority: str = ""
    max_priority: str = ""
    weight: float = 1.0


class IdentityPlan(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A NATS client identity's plan (``zml creds issue NAME --plan ...``), stored in the keys
    bucket under ``identity.<public key>`` so that every router finds it. The router limits
    requests whose reply inbox names that identity exactly as a gateway limits an API key."""

    name: str
    public_key: str
    plan: str = "custom"
    limits: PlanLimits = PlanLimits()
    #: Share this API key's plan and budget instead (HTTP and NATS count together); its label
    #: and default policy apply too.
    key_id: str = ""
    created_at: float = 0.0


class Hold(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Concurrency slots one limiter replica holds for its in-flight requests (renewed while
    it holds any, so a replica that dies frees them when ``until`` passes)."""

    slots: int = 0
    until: float = 0.0


class LimitState(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One limited identity's usage, shared by every gateway through compare-and-set.

    Requests and tokens are counted in fixed one-minute windows; the limit applies to a sliding
    estimate (previous window weighted by how much of it still overlaps the last 60 s)."""

    window: int = 0
    requests: int = 0
    prev_requests: int = 0
    tokens: int = 0
    prev_tokens: int = 0
    #: In-flight request id -> unix time its lease ends (a gateway that dies cannot leak them).
    #: Written by limiters before per-replica leases; still counted, no longer written.
    leases: dict[str, float] = {}
    #: Limiter replica -> the concurrency slots it holds (zmlcore.access.shares).
    holds: dict[str, Hold] = {}


api_key_decoder = msgspec.json.Decoder(ApiKeyRecord)
identity_plan_decoder = msgspec.json.Decoder(IdentityPlan)
limit_state_decoder = msgspec.json.Decoder(LimitState)
