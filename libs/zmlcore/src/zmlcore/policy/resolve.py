"""Policy resolution: per-call (name or inline) -> model default -> account default.

Validation happens when a policy is created (config load, inline policy): an unknown strategy
or family, a negative weight or a chain of unregistered families raises PolicyConfigError.

>>> from zmlcore.config import parse_config
>>> cfg = parse_config({"nodes": [{"id": "h1", "accelerator": "nvidia_h100", "endpoint": "http://h1"}]})
>>> resolve_policy(cfg, "m", None).name
'balanced'
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from zmlcore.config import BUILTIN_POLICIES, PolicyConfig, ZMLConfig, validate_policy
from zmlcore.errors import PolicyConfigError
from zmlcore.messages import InlinePolicy

#: Every value ``strategy`` may take.
STRATEGY_NAMES = ("latency", "cost", "availability", "round_robin", "weighted", "balanced", "chain")


@dataclass(slots=True, frozen=True)
class ResolvedPolicy:
    name: str
    config: PolicyConfig
    #: Families in preference order (empty: every registered family, in registration order).
    chain: tuple[str, ...]

    @property
    def strategy(self) -> str:
        if self.config.strategy:
            return self.config.strategy
        if self.config.cost_priority:
            return "chain"
        return "balanced"


def builtin_policy(name: str) -> ResolvedPolicy:
    """A built-in policy by name (latency, cost, availability, round_robin, balanced)."""
    if name not in BUILTIN_POLICIES:
        raise PolicyConfigError(f"unknown built-in policy {name!r} (one of {', '.join(BUILTIN_POLICIES)})")
    cfg = PolicyConfig(cost_priority="balanced") if name == "balanced" else PolicyConfig(strategy=name)  # type: ignore[arg-type]
    return ResolvedPolicy(name, cfg, ())


def check_policy(name: str, pol: PolicyConfig, families: list[str], where: str | None = None) -> None:
    """Everything :func:`zmlcore.config.validate_policy` checks, plus the fields msgspec only
    checks when decoding (a PolicyConfig built in Python skips that)."""
    where = where or f"policy {name!r}"
    if pol.strategy is not None and pol.strategy not in STRATEGY_NAMES:
        raise PolicyConfigError(f"{where}.strategy: unknown strategy {pol.strategy!r} (one of {', '.join(STRATEGY_NAMES)})")
    if pol.cost_priority is not None and pol.cost_priority not in ("cost", "balanced", "latency"):
        raise PolicyConfigError(f"{where}.cost_priority: {pol.cost_priority!r} is not cost, balanced or latency")
    for field in ("latency_weight", "cost_weight", "queue_threshold", "health_threshold"):
        value = getattr(pol, field)
        if value is not None and value < 0:
            raise PolicyConfigError(f"{where}.{field}: must be >= 0, got {value}")
    if pol.latency_target_ms is not None and pol.latency_target_ms <= 0:
        raise PolicyConfigError(f"{where}.latency_target_ms: must be > 0, got {pol.latency_target_ms}")
    validate_policy(name, pol, families, where)


def make_policy(name: str, pol: PolicyConfig, families: list[str]) -> ResolvedPolicy:
    """Validate and resolve a policy object (the SDK's ``zml.Policy`` at creation time)."""
    check_policy(name, pol, families)
    return ResolvedPolicy(name, pol, tuple(pol.chain()))


def resolve_policy(
    cfg: ZMLConfig,
    model: str,
    per_call: str | InlinePolicy | None,
    families: list[str] | None = None,
) -> ResolvedPolicy:
    """Return the policy for one request. Raises PolicyConfigError for unknown names.

    Order: the per-call policy (a name or an inline policy), else the model's ``policy``
    (aliases resolved), else ``[defaults] policy`` (built-in ``balanced``: cost_priority
    balanced over every registered family in registration order).
    """
    fams = families if families is not None else cfg.families()
    if isinstance(per_call, InlinePolicy):
        raw = {k: v for k, v in _inline_items(per_call) if v is not None and k != "name"}
        try:
            pol = msgspec.convert(raw, PolicyConfig)
        except msgspec.ValidationError as exc:
            raise PolicyConfigError(f"inline policy {per_call.name!r}: {exc}") from exc
        return make_policy(per_call.name, pol, fams)
    name = per_call
    if name is None:
        mc = cfg.models.get(cfg.resolve_model(model))
        name = mc.policy if mc and mc.policy else cfg.defaults.policy
    pols = cfg.all_policies()
    if name in pols:
        pol = pols[name]
        return ResolvedPolicy(name, pol, tuple(pol.chain()))
    if name in BUILTIN_POLICIES:
        return builtin_policy(name)
    known = sorted(set(pols) | set(BUILTIN_POLICIES))
    raise PolicyConfigError(f"unknown policy {name!r} (known: {', '.join(known)})")


def _inline_items(p: InlinePolicy) -> list[tuple[str, object]]:
    return [(f, getattr(p, f)) for f in p.__struct_fields__]
