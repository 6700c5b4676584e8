"""The layering of docs/architecture.md, checked: import-linter's contracts in pyproject.toml
(zmlcore at the bottom, services independent of each other, the SDK above zmlcore and beside the
services, zmlcore's and the router's concepts in layers, no import circle inside any package, no
NATS or HTTP library in the pure modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_kept() -> None:
    cli = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(cli), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout
