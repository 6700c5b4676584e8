"""How many gateway and router processes `zml up` runs: a pure function of the cores and the
``processes`` settings (``[gateway]`` and ``[router]``), so the rule is tested without processes.

The rule comes from measurements (docs/benchmarks.md, "Processes per core"): per request the
router costs about twice the gateway, and a process beyond the cores only adds context
switches. So: one router per two cores, at least one; one gateway per two cores, at least one;
on a 2-core box that is one of each (2 gateways + 1 router measured slower there).
"""

from __future__ import annotations

import os
from typing import Literal

Count = int | Literal["auto"]


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def plan_processes(cores: int, gateways: Count = "auto", routers: Count = "auto") -> tuple[int, int]:
    """(gateway processes, router processes) for a machine with ``cores`` cores."""
    cores = max(1, cores)
    g = max(1, cores // 2) if gateways == "auto" else gateways
    r = max(1, cores // 2) if routers == "auto" else routers
    return max(1, g), max(1, r)
