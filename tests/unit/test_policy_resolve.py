"""Resolution order and validation (PolicyConfigError at load or creation)."""

from __future__ import annotations

import pytest

from zmlcore.config import PolicyConfig, parse_config
from zmlcore.errors import ConfigError, PolicyConfigError
from zmlcore.messages import InlinePolicy
from zmlcore.policy import builtin_policy, check_policy, make_policy, resolve_policy

NODES = [
    {"id": "h1", "accelerator": "nvidia_h100", "endpoint": "http://h1"},
    {"id": "m1", "accelerator": "amd_mi300x", "endpoint": "http://m1"},
]


def cfg(**extra):
    return parse_config({"nodes": NODES, **extra})


def test_account_default_is_balanced_over_registered_families():
    c = cfg()
    p = resolve_policy(c, "m", None)
    assert p.name == "balanced" and p.strategy == "chain" and p.config.cost_priority == "balanced"
    assert p.chain == ()  # every family, in registration order
    assert c.families() == ["H100", "MI300X"]


def test_model_default_beats_account_default():
    c = cfg(models={"llama": {"policy": "latency", "aliases": ["l3"]}}, defaults={"policy": "cost"})
    assert resolve_policy(c, "llama", None).name == "latency"
    assert resolve_policy(c, "l3", None).name == "latency"  # alias
    assert resolve_policy(c, "other", None).name == "cost"


def test_per_call_name_beats_model_default():
    c = cfg(models={"llama": {"policy": "latency"}}, policies={"prod": {"accelerator_chain": ["MI300X", "H100"], "cost_priority": "cost"}})
    p = resolve_policy(c, "llama", "prod")
    assert p.name == "prod" and p.chain == ("MI300X", "H100") and p.strategy == "chain"
    assert resolve_policy(c, "llama", "availability").strategy == "availability"


def test_both_table_spellings():
    c = cfg(policy={"custom_cost_latency": {"strategy": "weighted", "latency_weight": 0.4, "cost_weight": 0.6, "queue_threshold": 8}})
    p = resolve_policy(c, "m", "custom_cost_latency")
    assert p.strategy == "weighted" and p.config.queue_threshold == 8


def test_inline_policy_beats_everything():
    c = cfg(models={"m": {"policy": "latency"}})
    p = resolve_policy(c, "m", InlinePolicy(name="llama3-production", accelerator_chain=["H100", "MI300X"], latency_target_ms=500, cost_priority="balanced"))
    assert p.name == "llama3-production" and p.chain == ("H100", "MI300X")


def test_unknown_policy_name():
    with pytest.raises(PolicyConfigError, match="unknown policy"):
        resolve_policy(cfg(), "m", "nope")


@pytest.mark.parametrize(
    ("inline", "match"),
    [
        ({"accelerator_chain": ["TPUv5"]}, "not registered"),
        ({"strategy": "fastest"}, "strategy"),
        ({"strategy": "weighted", "latency_weight": -1.0}, "latency_weight"),
        ({"strategy": "weighted", "cost_weight": -0.5, "latency_weight": 1.0}, "cost_weight"),
        ({"strategy": "weighted"}, "weighted"),
        ({"cost_priority": "cheap"}, "cost_priority"),
        ({"accelerator_chain": ["Gaudi2"]}, "Gaudi2"),  # a known type, but not registered here
        ({"queue_on_saturation": True}, "max_queue_ms"),
        ({"accelerator_chain": ["H100", "MI300X", "h100"]}, r"'H100' is listed more than once \(places 1 and 3"),
    ],
)
def test_invalid_inline_policy(inline, match):
    with pytest.raises(PolicyConfigError, match=match):
        resolve_policy(cfg(), "m", InlinePolicy(name="bad", **inline))


@pytest.mark.parametrize(
    ("pol", "match"),
    [
        ({"strategy": "fastest"}, "strategy"),
        ({"latency_weight": -1}, "latency_weight"),
        ({"accelerator_chain": ["TPUv5"]}, "not registered"),
    ],
)
def test_invalid_policy_fails_at_load(pol, match):
    with pytest.raises(ConfigError, match=match):
        cfg(policies={"bad": pol})


@pytest.mark.parametrize(
    ("pc", "match"),
    [
        (PolicyConfig(strategy="fastest"), "unknown strategy"),  # type: ignore[arg-type]
        (PolicyConfig(strategy="weighted", latency_weight=-1.0), "latency_weight"),
        (PolicyConfig(queue_threshold=-2), "queue_threshold"),
        (PolicyConfig(latency_target_ms=0), "latency_target_ms"),
        (PolicyConfig(accelerator_chain=["H100", "Inf2"]), "Inferentia2"),
        (PolicyConfig(cost_priority="cheap"), "cost_priority"),  # type: ignore[arg-type]
    ],
)
def test_policy_objects_validated_at_creation(pc, match):
    with pytest.raises(PolicyConfigError, match=match):
        make_policy("p", pc, ["H100", "MI300X"])


@pytest.mark.parametrize(
    ("pol", "match"),
    [
        ({"accelerator_chain": ["H100", "MI300X", "H100"]},
         r"policies\.bad\.accelerator_chain: family 'H100' is listed more than once \(places 1 and 3 of "
         r"H100 -> MI300X -> H100\)"),
        ({"accelerator_chain": ["MI300X", "mi300x"]}, r"'MI300X' is listed more than once \(places 1 and 2"),
        ({"accelerator_chain": ["nvidia_h100", "H100"]}, r"'H100' is listed more than once"),  # alias of one family
        ({"accelerator_preference": [{"family": "H100", "priority": 1}, {"family": "MI300X", "priority": 2},
                                     {"family": "H100", "priority": 3}]},
         r"policies\.bad\.accelerator_preference: family 'H100' is listed more than once"),
    ],
)
def test_a_repeated_family_in_a_chain_is_refused_at_load(pol, match):
    with pytest.raises(PolicyConfigError, match=match):
        cfg(policies={"bad": pol})
    with pytest.raises(PolicyConfigError, match="listed more than once"):
        make_policy("p", PolicyConfig(**{k: v for k, v in pol.items() if k == "accelerator_chain"}
                                      or {"accelerator_chain": ["H100", "H100"]}), ["H100", "MI300X"])


def test_make_policy_ok_and_aliases():
    p = make_policy("p", PolicyConfig(accelerator_chain=["h100", "mi300x"], cost_priority="latency"), ["H100", "MI300X"])
    assert p.chain == ("H100", "MI300X")
    check_policy("p", PolicyConfig(strategy="weighted", latency_weight=1.0), ["H100"])


def test_builtin_policies():
    for name in ("latency", "cost", "availability", "round_robin"):
        assert builtin_policy(name).strategy == name
    with pytest.raises(PolicyConfigError):
        builtin_policy("weighted")
