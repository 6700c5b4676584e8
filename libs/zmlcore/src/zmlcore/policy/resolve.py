"""Policy resolution: per-call (name or inline) -> model default -> account default."""

from __future__ import annotations

from dataclasses import dataclass

from zmlcore.config import BUILTIN_POLICIES, PolicyConfig, ZMLConfig, validate_policy
from zmlcore.errors import PolicyConfigError
from zmlcore.messages import InlinePolicy


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


def _builtin(name: str) -> PolicyConfig:
    return PolicyConfig(strategy=name)  # type: ignore[arg-type]


def resolve_policy(
    cfg: ZMLConfig,
    model: str,
    per_call: str | InlinePolicy | None,
    families: list[str] | None = None,
) -> ResolvedPolicy:
    """Return the policy for one request. Raises PolicyConfigError for unknown names."""
    fams = families if families is not None else cfg.families()
    if isinstance(per_call, InlinePolicy):
        raw = {k: v for k, v in _inline_items(per_call) if v is not None and k != "name"}
        try:
            import msgspec

            pol = msgspec.convert(raw, PolicyConfig)
        except Exception as exc:  # msgspec.ValidationError
            raise PolicyConfigError(f"inline policy {per_call.name!r}: {exc}") from exc
        validate_policy(per_call.name, pol, fams, f"policy {per_call.name!r}")
        return ResolvedPolicy(per_call.name, pol, tuple(pol.chain()))
    name = per_call
    if name is None:
        mc = cfg.models.get(model)
        name = mc.policy if mc and mc.policy else cfg.defaults.policy
    pols = cfg.all_policies()
    if name in pols:
        pol = pols[name]
        return ResolvedPolicy(name, pol, tuple(pol.chain()))
    if name in BUILTIN_POLICIES:
        return ResolvedPolicy(name, _builtin(name), ())
    known = sorted(set(pols) | set(BUILTIN_POLICIES))
    raise PolicyConfigError(f"unknown policy {name!r} (known: {', '.join(known)})")


def _inline_items(p: InlinePolicy) -> list[tuple[str, object]]:
    return [(f, getattr(p, f)) for f in p.__struct_fields__]
