"""How the default suite's files are spread over its 3 processes (pytest-xdist, `--dist loadfile`).

Two changes to xdist's own loadfile scheduling, both about the suite's wall time on 2 cores:

- The files that use the shared stack (``zml_stack`` in tests/conftest.py) go to one process as
  one unit, one after the other: one stack is started instead of one per process, and it is
  stopped once they are done (it costs ~13% of a core while it runs, idle or not).
- Units are handed out longest first (as last measured; see ``record``), so that no long file is
  left to run alone at the end while the other processes have nothing to do. Without a record (a
  fresh clone) the few files known to be long go first, then collection order.

Which tests run, and what each checks, is not changed: only where and in what order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SHARED_STACK = "zml_stack"
#: The shared stack's unit in the schedule (a name no file has).
SHARED_UNIT = "shared zml_stack files"
CACHE_KEY = "zml/unit_seconds"

#: Rough seconds per unit on an idle 2-core box (about half what a loaded full run measured,
#: issue 27, docs/benchmarks.md), for the order of a run with nothing recorded yet (a fresh
#: clone). Only the order matters; every other file counts as 0.
KNOWN_LONG = {
    SHARED_UNIT: 150.0,
    "tests/e2e/test_doc_examples.py": 60.0,
    "tests/e2e/test_zml_up.py": 50.0,
    "tests/e2e/test_router_behaviour.py": 40.0,
    "tests/unit/test_typing.py": 35.0,
    "tests/e2e/test_nodes_cli.py": 30.0,
    "tests/e2e/test_operator_identity.py": 30.0,
    "tests/e2e/test_placement_apply.py": 30.0,
    "tests/e2e/test_batch_api.py": 25.0,
    "tests/e2e/test_keys.py": 22.0,
    "tests/e2e/test_router_failover.py": 22.0,
    "tests/e2e/test_bus_permissions.py": 20.0,
    "tests/e2e/test_zml_up_batches.py": 20.0,
    "tests/e2e/test_audio.py": 18.0,
}


def uses_shared_stack(path: Path) -> bool:
    """A test file that asks for the shared stack (by name: the controller does not collect)."""
    try:
        return SHARED_STACK in path.read_text(encoding="utf-8")
    except OSError:
        return False


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadFileScheduling

    class Scheduler(LoadFileScheduling):  # type: ignore[misc]
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self._shared: dict[str, bool] = {}
            cache = getattr(config, "cache", None)  # none under -p no:cacheprovider
            recorded = cache.get(CACHE_KEY, {}) if cache is not None else {}
            self._seconds: dict[str, float] = {**KNOWN_LONG, **recorded} if recorded else dict(KNOWN_LONG)
            self._ordered = False

        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            if file not in self._shared:
                self._shared[file] = uses_shared_stack(config.rootpath / file)
            return SHARED_UNIT if self._shared[file] else file

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:  # the queue is whole at the first assignment
                units = sorted(self.workqueue.items(), key=lambda kv: -self._seconds.get(kv[0], 0.0))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._ordered = True
            super()._assign_work_unit(node)

    return Scheduler(config, log)


class Record:
    """Seconds per unit of this run (the controller sees every report), kept in pytest's cache
    for the next run's order. Units not run this time keep their last value."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}
        self.shared: dict[str, bool] = {}
        self.ran = 0

    def add(self, report: pytest.TestReport) -> None:
        file = report.nodeid.split("::", 1)[0]
        if file not in self.shared:
            self.shared[file] = uses_shared_stack(self.config.rootpath / file)
        unit = SHARED_UNIT if self.shared[file] else file
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration
        self.ran += report.when == "call"

    def save(self) -> None:
        cache = getattr(self.config, "cache", None)  # none under -p no:cacheprovider
        if cache is None or self.ran < 500:  # a few files' run says little about the order
            return
        old = cache.get(CACHE_KEY, {})
        cache.set(CACHE_KEY, {**old, **{k: round(v, 1) for k, v in self.seconds.items()}})
