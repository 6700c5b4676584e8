"""zmlcore.runtime.sizing: how many gateway and router processes `zml up` runs, and its nats-server's GOMAXPROCS."""

from __future__ import annotations

import pytest

from zmlcore.config import ConfigError, parse_config
from zmlcore.runtime.sizing import nats_env, nats_gomaxprocs, plan_processes, usable_cores


@pytest.mark.parametrize(("cores", "want"), [(1, (1, 1)), (2, (1, 1)), (3, (1, 1)), (4, (2, 2)), (16, (8, 8))])
def test_auto_is_one_of_each_per_two_cores(cores: int, want: tuple[int, int]) -> None:
    assert plan_processes(cores) == want


def test_explicit_counts_win_and_stay_at_least_one() -> None:
    assert plan_processes(2, 3, "auto") == (3, 1)
    assert plan_processes(64, 1, 2) == (1, 2)
    assert plan_processes(0, "auto", "auto") == (1, 1)
    assert usable_cores() >= 1


def test_processes_keys_are_validated_at_load() -> None:
    cfg = parse_config({"gateway": {"processes": 2}, "router": {"processes": "auto"}})
    assert (cfg.gateway.processes, cfg.router.processes) == (2, "auto")
    for bad in (0, "many", -1):
        with pytest.raises(ConfigError, match="processes"):
            parse_config({"gateway": {"processes": bad}})


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 1), (4, 1), (8, 2), (64, 16)])
def test_nats_gomaxprocs_auto_is_one_per_four_cores(cores: int, want: int) -> None:
    assert nats_gomaxprocs(cores) == want
    assert nats_env(cores) == {"GOMAXPROCS": str(want)}


def test_nats_gomaxprocs_explicit_wins() -> None:
    assert nats_gomaxprocs(2, 3) == 3
    assert nats_env(64, 2) == {"GOMAXPROCS": "2"}


def test_nats_server_gomaxprocs_is_validated_at_load() -> None:
    assert parse_config({}).nats.server_gomaxprocs == "auto"
    assert parse_config({"nats": {"server_gomaxprocs": 2}}).nats.server_gomaxprocs == 2
    for bad in (0, -1, "many", 1.5, True, None):
        with pytest.raises(ConfigError, match=r"nats\.server_gomaxprocs"):
            parse_config({"nats": {"server_gomaxprocs": bad}})
