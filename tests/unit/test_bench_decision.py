"""The decision-time bench as docs/benchmarks.md runs it, at a small scale: both key sources
print a row whose cells parse, and the gateway's keying is reported apart (it costs more than
the router's parse of the header it sends)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "bench_decision.py"


def _row(keys_from: str) -> list[str]:
    out = subprocess.run([sys.executable, str(BENCH), "--cache", "--quick", "--sizes", "40", "--entries", "20000",
                          "--keys-from", keys_from], capture_output=True, text=True, timeout=240, check=True).stdout
    assert re.search(r"box speed \(a fixed 1 M-step Python loop\) before / after: [\d.]+ / [\d.]+ ms", out)
    rows = [line for line in out.splitlines() if line.startswith("| 40 |")]
    assert len(rows) == 1, out
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("keys_from", ["router", "gateway"])
def test_the_cache_table_runs(keys_from: str) -> None:
    cells = _row(keys_from)
    for cell in cells[1:4]:  # latency, balanced, cost: "median / p99 (cpu median / cpu p99)"
        med, p99 = (float(x) for x in re.match(r"([\d.]+) / ([\d.]+) \(", cell).groups())  # type: ignore[union-attr]
        assert 0 < med <= p99
    keys = float(cells[6])
    warm = int(cells[7].rstrip("%"))
    assert keys > 0 and 50 <= warm <= 100
    if keys_from == "gateway":
        # the gateway's own keying, reported apart, costs more than the router's parse of its header
        assert float(cells[8]) > keys
    else:
        assert cells[8] == "-"
