"""The SDK's public surface: __all__, documentation of every public name, Policy validation,
endpoint/key resolution, py.typed and mypy --strict."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import zml
from zml._config import DEFAULT_ENDPOINT, resolve

ROOT = Path(__file__).resolve().parents[2]

FLEET = """
[[nodes]]
id = "h1"
accelerator = "nvidia_h100"
endpoint = "http://127.0.0.1:1"
[[nodes]]
id = "m1"
accelerator = "amd_mi300x"
endpoint = "http://127.0.0.1:2"
[gateway]
host = "0.0.0.0"
port = 9191
api_keys = ["k1", "k2"]
"""


def test_all_lists_exactly_the_public_names() -> None:
    public = {n for n, v in vars(zml).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(zml.__all__) - {"__version__"} == public
    assert sorted(zml.__all__) == list(zml.__all__)
    for name in zml.__all__:
        assert hasattr(zml, name)


def test_every_public_name_is_documented() -> None:
    doc = (ROOT / "docs" / "sdk.md").read_text()
    missing = [n for n in zml.__all__ if f"`zml.{n}" not in doc and f"`{n}" not in doc]
    assert not missing, f"docs/sdk.md does not document {missing}"
    for method in ("infer", "infer_stream", "infer_batch", "nodes", "models", "close", "generate", "generate_batch",
                   "embed", "transcribe", "translate", "transcribe_batch"):
        assert f"{method}(" in doc, method


def test_py_typed_is_shipped() -> None:
    assert (Path(zml.__file__).parent / "py.typed").exists()


def test_sync_and_async_clients_are_twins() -> None:
    for name in ("infer", "infer_stream", "infer_batch", "nodes", "models", "generate", "generate_batch", "embed",
                 "transcribe", "translate", "transcribe_batch"):
        s = inspect.signature(getattr(zml.Client, name))
        a = inspect.signature(getattr(zml.AsyncClient, name))
        assert list(s.parameters) == list(a.parameters), name
    assert list(inspect.signature(zml.Client).parameters) == list(inspect.signature(zml.AsyncClient).parameters)
    assert list(inspect.signature(zml.Client).parameters)[:5] == [
        "endpoint", "api_key", "timeout", "max_connections", "config_path"]


# --- Policy ---------------------------------------------------------------------------------------


def test_policy_valid_and_wire_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no zml.toml: values only
    p = zml.Policy(name="llama3-production", accelerator_chain=["H100", "MI300X", "H100_PCIe"],
                   latency_target_ms=500, cost_priority="balanced")
    assert p.to_wire().accelerator_chain == ["H100", "MI300X", "H100_PCIe"]


@pytest.mark.parametrize("kwargs", [
    {"cost_priority": "cheapest"},
    {"strategy": "fastest"},
    {"latency_weight": -1.0},
    {"cost_weight": -0.5, "strategy": "weighted"},
    {"latency_target_ms": 0},
    {"queue_threshold": -3},
    {"strategy": "weighted"},  # needs a weight
    {"queue_on_saturation": True},  # needs max_queue_ms
    {"accelerator_chain": "H100"},
    {"accelerator_chain": ["H100"], "accelerator_preference": [{"family": "H100"}]},
])
def test_policy_invalid_values(kwargs: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zml.PolicyConfigError):
        zml.Policy("p", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(zml.PolicyConfigError):
        zml.Policy("")


def test_policy_families_from_zml_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "zml.toml").write_text(FLEET)
    sub = tmp_path / "app" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)  # found in a parent folder
    zml.Policy("ok", accelerator_chain=["H100", "mi300x"])
    with pytest.raises(zml.PolicyConfigError, match="H100_PCIe"):
        zml.Policy("p", accelerator_chain=["H100", "H100_PCIe"])
    with pytest.raises(zml.PolicyConfigError):
        zml.Policy("p", accelerator_chain=["Gaudi2"], families=["H100"])
    zml.Policy("p", accelerator_chain=["Gaudi2"], families=["Gaudi2"])
    with pytest.raises(zml.PolicyConfigError):
        zml.Policy("p", accelerator_chain=["A100"], config_path=tmp_path / "zml.toml")


# --- endpoint and key resolution ------------------------------------------------------------------


def test_resolution_order(tmp_path: Path) -> None:
    (tmp_path / "zml.toml").write_text(FLEET)
    none: dict[str, str] = {}
    s = resolve(None, None, None, env=none, cwd=tmp_path)
    assert (s.endpoint, s.api_key) == ("http://127.0.0.1:9191", "k1")
    s = resolve(None, None, None, env={"ZML_ENDPOINT": "nats://n:4222", "ZML_API_KEY": "ek"}, cwd=tmp_path)
    assert (s.endpoint, s.api_key) == ("nats://n:4222", "ek")
    s = resolve("http://x:1/", "ak", None, env={"ZML_ENDPOINT": "nats://n:4222"}, cwd=tmp_path)
    assert (s.endpoint, s.api_key) == ("http://x:1", "ak")
    s = resolve(None, None, tmp_path / "zml.toml", env={"ZML_GATEWAY_PORT": "7000"})
    assert s.endpoint == "http://127.0.0.1:7000" and s.config is not None
    empty = Path(tempfile.mkdtemp(prefix="zml-noconf-"))
    if resolve(None, None, None, env=none, cwd=empty).config is None:  # no zml.toml above /tmp
        assert resolve(None, None, None, env=none, cwd=empty).endpoint == DEFAULT_ENDPOINT
    with pytest.raises(zml.ConfigError):
        resolve("ftp://x", None, None, env=none, cwd=empty)
    with pytest.raises(zml.ConfigError):
        resolve(None, None, tmp_path / "missing.toml", env=none)


def test_client_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZML_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("ZML_API_KEY", "secret")
    with zml.Client() as c:
        assert (c.endpoint, c.api_key) == ("http://127.0.0.1:9", "secret")


# --- typing ---------------------------------------------------------------------------------------


def test_mypy_strict_on_the_sdk_the_docs_and_the_examples(tmp_path: Path) -> None:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed")
    doc = (ROOT / "docs" / "sdk.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        (tmp_path / f"doc_example_{i}.py").write_text(block)
    env = {**os.environ, "MYPYPATH": f"{ROOT / 'libs/zmlcore/src'}{os.pathsep}{ROOT / 'sdk/src'}"}
    sdk = ROOT / "sdk/src/zml"
    # The SDK's own modules (the other cli/ commands belong to the services' owners).
    ours = [*sdk.glob("*.py"), *(sdk / "cli" / f"{m}.py" for m in ("_common", "infer", "batch", "bench", "nodes"))]
    files = [*map(str, sorted(ours)), *map(str, sorted(tmp_path.glob("*.py"))),
             *map(str, sorted((ROOT / "docs" / "examples").glob("*.py")))]
    p = subprocess.run([mypy, "--strict", "--no-error-summary", "--follow-imports=silent", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
