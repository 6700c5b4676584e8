"""Ports picked for servers not bound yet are recorded machine-wide (zmlcore.runtime.portbook):
two processes picking at once never get the same port (CI once saw a service of one `zml up`
die on a metrics port another process had picked too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zmlcore.runtime import portbook

PICKER = """
import json, sys
from pathlib import Path
from zmlcore.runtime import launch, portbook
portbook.PATH = Path(sys.argv[1])
print(json.dumps([launch.listen_ports(1) for _ in range(int(sys.argv[2]))]))
"""


def test_a_claim_holds_for_its_time_and_then_lapses(tmp_path: Path) -> None:
    book = tmp_path / "book"
    assert portbook.claim([20001, 20002], path=book, now=1000.0)
    assert not portbook.claim([20002], path=book, now=1001.0)  # picked a second ago
    assert not portbook.claim([20000, 20001], path=book, now=1001.0)  # one of a run is enough
    assert portbook.claim([20000], path=book, now=1001.0)  # nothing was recorded by the refusal
    assert portbook.claim([20002], path=book, now=1000.0 + portbook.HOLD_S + 1)  # lapsed
    book.write_text(book.read_text() + " garbage 7: :x 20003:1000.0")
    assert not portbook.claim([20003], path=book, now=1002.0)  # read past what it cannot parse
    assert portbook.claim([20004], path=book, now=1002.0)


def test_no_shared_record_leaves_the_process_memory_only(tmp_path: Path) -> None:
    assert portbook.claim([20001], path=tmp_path / "missing-dir" / "book")


def test_two_processes_picking_at_once_never_share_a_port(tmp_path: Path) -> None:
    book = tmp_path / "book"
    n = 300  # two of 300 picks in ~12,000 ports: ~7 shared ones expected without the record
    procs = [subprocess.Popen([sys.executable, "-c", PICKER, str(book), str(n)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    picks = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [len(set(p)) for p in picks] == [n, n]
    assert not set(picks[0]) & set(picks[1])
