"""[disaggregation], node roles, kv_group/kv_gbps and [[kv_links]]: validated at load."""

from __future__ import annotations

import pytest

from zmlcore.config import parse_config
from zmlcore.errors import ConfigError


def node(i: str, roles: list[str] | None = None, group: str | None = "g", gbps: float | None = 100.0,
         models: list[str] | None = None) -> dict[str, object]:
    n: dict[str, object] = {"id": i, "accelerator": "nvidia_h100", "endpoint": f"http://127.0.0.1:1/{i}",
                            "models": models or ["m"]}
    if roles is not None:
        n["roles"] = roles
    if group is not None:
        n["kv_group"] = group
    if gbps is not None:
        n["kv_gbps"] = gbps
    return n


def test_defaults_are_todays_behaviour() -> None:
    cfg = parse_config({"nodes": [node("a", group=None, gbps=None)]})
    assert cfg.nodes[0].roles == ["prefill", "decode"] and cfg.nodes[0].kv_group is None
    assert cfg.disaggregation.enabled is False and cfg.kv_links == []


def test_a_split_fleet_loads() -> None:
    cfg = parse_config({
        "disaggregation": {"enabled": True, "min_uncached_tokens": 1024, "min_gain": 0.2},
        "nodes": [node("p", ["prefill"]), node("d", ["decode"], gbps=50.0)],
        "kv_links": [{"prefill": "p", "decode": "d", "gbps": 200.0}],
        "models": {"m": {"kv_bytes_per_token": 65536}},
    })
    assert cfg.disaggregation.min_uncached_tokens == 1024 and cfg.kv_links[0].gbps == 200.0
    assert cfg.models["m"].kv_bytes_per_token == 65536


@pytest.mark.parametrize(("data", "words"), [
    ({"nodes": [node("a", [])]}, "nodes[0].roles: give at least one"),
    ({"nodes": [node("a", ["prefill", "prefill"]), node("d", ["decode"])]}, "list each role once"),
    ({"nodes": [node("a", ["both"])]}, "one of: prefill, decode"),
    ({"nodes": [node("a", gbps=None)]}, "nodes[0].kv_gbps"),
    ({"nodes": [node("a", gbps=0.0)]}, "nodes[0].kv_gbps"),
    ({"nodes": [node("p", ["prefill"])]}, "prefill-only node 'p' has no decode node"),
    ({"nodes": [node("p", ["prefill"]), node("d", ["decode"], group="h")]}, "prefill-only node 'p'"),
    ({"nodes": [node("p", ["prefill"]), node("d", ["decode"], models=["other"])]}, "prefill-only node 'p'"),
    ({"nodes": [node("p"), node("d")], "kv_links": [{"prefill": "p", "decode": "x", "gbps": 1}]},
     "kv_links[0].decode: unknown node 'x'"),
    ({"nodes": [node("p", ["prefill"]), node("d", ["decode"])],
      "kv_links": [{"prefill": "d", "decode": "p", "gbps": 1}]}, "does not take prefill legs"),
    ({"nodes": [node("p"), node("d", group="h")], "kv_links": [{"prefill": "p", "decode": "d", "gbps": 1}]},
     "not in one kv_group"),
    ({"nodes": [node("p")], "kv_links": [{"prefill": "p", "decode": "p", "gbps": 1}]}, "to itself"),
    ({"nodes": [node("p")], "disaggregation": {"min_gain": 1.5}}, "disaggregation.min_gain"),
    ({"nodes": [node("p")], "disaggregation": {"kv_bytes_per_tokn": 1}}, "kv_bytes_per_tokn"),
])
def test_mistakes_are_refused_at_load_naming_the_key(data: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "zml.toml")
    assert words in str(info.value) and "zml.toml" in str(info.value)


def test_a_node_added_at_run_time_takes_roles_without_its_peers() -> None:
    # zml nodes add --roles prefill --kv-group g --kv-gbps 100: validated alone (its decode
    # peers are elsewhere in the fleet), carried to its state.
    from zmlcore.messages import NodeSpec
    from zml_health.service import spec_to_config

    cfg = spec_to_config(NodeSpec(id="p9", accelerator="nvidia_h100", endpoint="http://h:1", models=["m"],
                                  roles=["prefill"], kv_group="g", kv_gbps=100.0))
    assert cfg.roles == ["prefill"] and cfg.kv_group == "g" and cfg.kv_gbps == 100.0
    with pytest.raises(ConfigError, match="kv_gbps"):
        spec_to_config(NodeSpec(id="p9", accelerator="nvidia_h100", endpoint="http://h:1", kv_group="g"))
