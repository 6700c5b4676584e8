"""zml._fleet: the families ``zml.Policy`` is checked against (zml.toml first, the fleet asked
only for families zml.toml does not name, once per CACHE_S, an unreachable fleet falling back
to what is known locally). The fleet is asked through the asker the package installs; here a
recording one stands in for the network (the real one runs in tests/e2e/test_runtime_fleet.py
over HTTP, NATS and gRPC)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import zml
from zml import _client, _fleet
from zml._errors import ConnectionError

TOML = '[[nodes]]\nid = "h1"\naccelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:1"\n'


class Fleet:
    def __init__(self, families: Sequence[str] | None) -> None:
        self.families = families
        self.asked: list[str] = []

    def __call__(self, endpoint: str, api_key: str | None, config_path: str | os.PathLike[str] | None,
                 timeout_s: float) -> Sequence[str]:
        self.asked.append(endpoint)
        if self.families is None:
            raise ConnectionError(f"cannot reach {endpoint}")
        return self.families


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZML_ENDPOINT", raising=False)
    yield tmp_path
    _fleet.ask_with(_client.fleet_families)  # what zml/__init__.py installs


def test_the_package_asks_through_a_real_client() -> None:
    assert _fleet._asker is _client.fleet_families


def test_a_family_only_the_fleet_knows_is_asked_for_once(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = Fleet(["Edge", "H100", "Edge", ""])
    _fleet.ask_with(fleet)
    monkeypatch.setenv("ZML_ENDPOINT", "nats://127.0.0.1:4222")
    zml.Policy(name="edge", accelerator_chain=["edge"])  # families compare case-blind
    with pytest.raises(zml.PolicyConfigError, match="Nowhere"):
        zml.Policy(name="typo", accelerator_chain=["Edge", "Nowhere"])
    assert fleet.asked == ["nats://127.0.0.1:4222"]  # the second policy used the kept answer
    assert _fleet.fleet_families(None) == ["Edge", "H100"]


def test_zml_toml_answers_first_and_names_the_fleet(here: Path) -> None:
    (here / "zml.toml").write_text(TOML + '[gateway]\nport = 9393\n')
    fleet = Fleet(["Edge"])
    _fleet.ask_with(fleet)
    zml.Policy(name="local", accelerator_chain=["H100"])
    assert fleet.asked == []  # zml.toml names every family: no network
    zml.Policy(name="both", accelerator_chain=["H100", "Edge"])
    assert fleet.asked == ["http://127.0.0.1:9393"]  # that zml.toml's gateway


def test_an_unreachable_fleet_leaves_what_is_known_locally(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fleet.ask_with(Fleet(None))
    monkeypatch.setenv("ZML_ENDPOINT", "http://127.0.0.1:1")
    zml.Policy(name="values-only", accelerator_chain=["Anything"])  # no fleet known: values only
    (here / "zml.toml").write_text(TOML)
    with pytest.raises(zml.PolicyConfigError, match="Nowhere"):
        zml.Policy(name="typo", accelerator_chain=["H100", "Nowhere"])


def test_no_fleet_named_means_no_asking(here: Path) -> None:
    fleet = Fleet(["Edge"])
    _fleet.ask_with(fleet)
    zml.Policy(name="values-only", accelerator_chain=["Nowhere"])
    _fleet.ask_with(None)
    assert _fleet.fleet_families(None) is None
    assert fleet.asked == []
