"""`zml up` moves the simulated nodes to other ports in a copy of the zml.toml (issue 10 item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zml.cli._simports import pick_ports, relocate, with_ports
from zml.cli.up import demo_config_path
from zmlcore.config import load_config
from zmlcore.errors import ConfigError
from zmlcore.runtime.launch import endpoint_port


def test_demo_fleet_moves_to_a_base_keeping_the_file(tmp_path: Path) -> None:
    cfg = load_config(demo_config_path())
    path, moved = relocate(demo_config_path(), cfg, 9102, tmp_path)
    # 9101 -> 9102 while 9102 -> 9103: moved all at once, not one after the other.
    assert [endpoint_port(n.endpoint)[1] for n in moved.nodes] == list(range(9102, 9102 + len(cfg.nodes)))
    assert [n.id for n in moved.nodes] == [n.id for n in cfg.nodes]
    assert "# The demo fleet" in Path(path).read_text()  # comments kept
    assert moved.models == cfg.models and moved.all_policies() == cfg.all_policies()


def test_free_ports_are_distinct(tmp_path: Path) -> None:
    cfg = load_config(demo_config_path())
    _, moved = relocate(demo_config_path(), cfg, None, tmp_path)
    ports = [endpoint_port(n.endpoint)[1] for n in moved.nodes]
    assert len(set(ports)) == len(ports) and not set(ports) & set(range(9101, 9108))


def test_only_whole_origins_in_strings_move() -> None:
    cfg = load_config(demo_config_path())
    node = cfg.nodes[0]
    text = (f'endpoint = "{node.endpoint}"\nprobe_endpoint = \'{node.endpoint}/zml\'\n'
            f'other = "{node.endpoint}0"\n# {node.endpoint}\n')
    out = with_ports(text, [node], {node.id: 4000})
    assert out == ('endpoint = "http://127.0.0.1:4000"\nprobe_endpoint = \'http://127.0.0.1:4000/zml\'\n'
                   f'other = "{node.endpoint}0"\n# {node.endpoint}\n')


def test_a_base_past_the_last_port_is_refused(tmp_path: Path) -> None:
    cfg = load_config(demo_config_path())
    with pytest.raises(ConfigError, match="outside"):
        relocate(demo_config_path(), cfg, 65533, tmp_path)
    assert pick_ports(cfg.nodes[:2], 100) == {cfg.nodes[0].id: 100, cfg.nodes[1].id: 101}
