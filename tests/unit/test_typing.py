"""mypy (the project's [tool.mypy] settings) over zmlcore and the services: type errors found
here were real bugs more than once (a None observed as a histogram value, variables read after
their except block)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_on_zmlcore_and_the_services() -> None:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed")
    targets = ["libs/zmlcore/src", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "services").glob("*/src")))]
    # mypy's incremental cache kept between runs (under the ignored .mypy_cache, apart from the
    # SDK test's, whose options differ): a run after the first checks what changed, ~1 s instead
    # of ~15 CPU-seconds. mypy rechecks a module whose source or dependencies changed.
    cache = ROOT / ".mypy_cache" / "zmlcore-and-services"
    p = subprocess.run([mypy, "--cache-dir", str(cache), *targets], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
