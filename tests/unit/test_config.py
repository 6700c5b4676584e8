from __future__ import annotations

from pathlib import Path

import pytest

from zmlcore.config import find_config, load_config, parse_config
from zmlcore.errors import ConfigError, PolicyConfigError

NODE = '[[nodes]]\nid = "h1"\naccelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:9001"\nmodels = ["m"]\n'


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "zml.toml"
    p.write_text(text)
    return p


def test_minimal_config_and_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, NODE), env={})
    node = cfg.nodes[0]
    assert node.effective_family == "H100" and node.effective_cost == 4.0
    assert cfg.health.poll_interval_s == 5.0 and cfg.router.cooldown_s == 30.0
    assert cfg.defaults.policy == "balanced" and cfg.families() == ["H100"]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (NODE.replace("nvidia_h100", "nvidia_h200"), "nodes[0].accelerator"),
        (NODE + "[gateway]\nport = \"eighty\"\n", "gateway.port"),
        (NODE + "[health]\npoll_intervl_s = 3\n", "poll_intervl_s"),
        (NODE.replace("http://", "ftp://"), "nodes[0].endpoint"),
        (NODE + NODE, "nodes[1].id"),
        (NODE + '[models.m]\npolicy = "nope"\n', "models"),
        (NODE + "[router]\ncooldown_s = -1\n", "router.cooldown_s"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)
    assert key in str(info.value)


def test_not_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[[nodes]\n"), env={})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "absent.toml", env={})


def test_both_policy_spellings(tmp_path: Path) -> None:
    text = NODE + (
        '[policy.custom_cost_latency]\nstrategy = "weighted"\nlatency_weight = 0.4\ncost_weight = 0.6\nqueue_threshold = 8\n'
        '[policies.llama3-production]\naccelerator_chain = ["H100"]\nlatency_target_ms = 500\ncost_priority = "balanced"\n'
    )
    cfg = load_config(write(tmp_path, text), env={})
    assert set(cfg.all_policies()) == {"custom_cost_latency", "llama3-production"}


def test_policy_errors_at_load(tmp_path: Path) -> None:
    with pytest.raises(PolicyConfigError, match="MI300X"):
        load_config(write(tmp_path, NODE + '[policies.p]\naccelerator_chain = ["H100", "MI300X"]\n'), env={})
    with pytest.raises(ConfigError, match="strategy"):
        load_config(write(tmp_path, NODE + '[policy.p]\nstrategy = "fastest"\n'), env={})
    with pytest.raises(ConfigError, match="latency_weight"):
        load_config(write(tmp_path, NODE + '[policy.p]\nstrategy = "weighted"\nlatency_weight = -1\n'), env={})


def test_environment_overrides(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, NODE), env={"ZML_NATS_URL": "nats://10.0.0.1:4222", "ZML_GATEWAY_PORT": "9999",
                                                  "ZML_API_KEYS": "a, b"})
    assert cfg.nats.url == "nats://10.0.0.1:4222" and cfg.gateway.port == 9999 and cfg.gateway.api_keys == ["a", "b"]
    with pytest.raises(ConfigError, match="ZML_GATEWAY_PORT"):
        load_config(write(tmp_path, NODE), env={"ZML_GATEWAY_PORT": "x"})


def test_find_config_walks_up(tmp_path: Path) -> None:
    write(tmp_path, NODE)
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert find_config(deep) == tmp_path / "zml.toml"


def test_shipped_demo_config_is_valid() -> None:
    from zml.cli.up import demo_config_path

    cfg = load_config(demo_config_path(), env={})
    types = [n.accelerator for n in cfg.nodes]
    assert types.count("nvidia_h100") >= 2 and types.count("amd_mi300x") >= 2
    assert "nvidia_a100" in types and "intel_gaudi2" in types
    assert all(n.sim is not None for n in cfg.nodes)
    assert any(len(n.models) > 1 for n in cfg.nodes)


def test_alias_resolution() -> None:
    cfg = parse_config({"models": {"m": {"aliases": ["small"]}}})
    assert cfg.resolve_model("small") == "m" and cfg.resolve_model("m") == "m" and cfg.resolve_model("x") == "x"


def test_configuration_doc_is_current() -> None:
    from zmlcore.config import reference_markdown

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert reference_markdown().strip() in doc, "regenerate the key reference in docs/configuration.md"


def test_trusted_proxies_are_addresses_or_networks() -> None:
    from zmlcore.config import parse_config

    assert parse_config({"gateway": {"trusted_proxies": ["10.0.0.0/8", "::1", "192.0.2.7"]}}).gateway.trusted_proxies
    for bad in ("*", "proxy.local", "10.0.0.0/40"):
        with pytest.raises(ConfigError, match="trusted_proxies"):
            parse_config({"gateway": {"trusted_proxies": [bad]}})


@pytest.mark.parametrize(("spelled", "backend"), [("llama.cpp", "llamacpp"), ("llama-cpp", "llamacpp"),
                                                  ("llama-server", "llamacpp"), ("vLLM", "vllm"),
                                                  ("SGLang", "sglang"), ("text-generation-inference", "tgi")])
def test_engines_as_their_users_spell_them(tmp_path: Path, spelled: str, backend: str) -> None:
    text = NODE + f'backend = "{spelled}"\n[nodes.sim]\nengine = "{spelled}"\n'
    node = load_config(write(tmp_path, text), env={}).nodes[0]
    assert node.backend == backend and node.sim is not None and node.sim.engine == backend


@pytest.mark.parametrize(("text", "says"), [
    (NODE + 'backend = "trt-llm"\n', "nodes[0].backend: Invalid enum value 'trt-llm' (one of: vllm, tgi, sglang, "
                                     "llamacpp, openai)"),
    (NODE + '[nodes.sim]\nengine = "trt"\n', "nodes[0].sim.engine: Invalid enum value 'trt' (one of: vllm, tgi"),
    (NODE + '[policy.p]\nstrategy = "fast"\n', "(one of: latency, cost, availability, round_robin, weighted"),
    (NODE + '[router]\nprocesses = "many"\n', "(one of: auto, an integer)"),
])
def test_a_value_outside_a_set_lists_the_set(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert says in str(info.value)


def test_a_body_limit_no_router_could_hold_is_refused_at_load(tmp_path: Path) -> None:
    text = NODE + "[gateway]\nmax_body_bytes = 67108864\n[defaults]\naudio_bytes_in_flight = 33554432\n"
    with pytest.raises(ConfigError, match=r"defaults.audio_bytes_in_flight \(33554432\) is below "
                                          r"gateway.max_body_bytes \(67108864\)"):
        load_config(write(tmp_path, text), env={})
