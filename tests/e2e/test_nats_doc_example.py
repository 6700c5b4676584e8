"""The nats-py example in docs/nats-api.md runs as written (pointed at the test broker)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import Stack

DOC = Path(__file__).resolve().parents[2] / "docs" / "nats-api.md"


def test_doc_example_runs(zml_stack: Stack, tmp_path: Path) -> None:
    code = re.search(r"## Example \(nats-py\)\n\n```python\n(.*?)```", DOC.read_text(), re.S).group(1)  # type: ignore[union-attr]
    code = code.replace("nats://127.0.0.1:4222", zml_stack.nats_url)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"\[(h100|a100|mi300x|gaudi2)-\d\]", out.stdout)
