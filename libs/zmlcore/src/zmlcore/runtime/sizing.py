"""How many gateway and router processes `zml up` runs, and how many cores its nats-server's Go
runtime uses: pure functions of the cores and the settings (``[gateway]``/``[router]``
``processes``, ``[nats] server_gomaxprocs``), so the rules are tested without processes.

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


def nats_gomaxprocs(cores: int, setting: Count = "auto") -> int:
    """GOMAXPROCS for the embedded nats-server.

    With more than one P, a message that wakes nats-server from idle also wakes a second
    thread spinning for work: on 2 cores one P spent less CPU per request at C=1 and at C=64
    (docs/benchmarks.md, "Runtime levers"). nats-server's share of ZML's CPU under load is about
    a tenth, so one P per four cores leaves it twice that before it queues."""
    if setting == "auto":
        return max(1, cores // 4)
    return max(1, setting)


def nats_env(cores: int, setting: Count = "auto") -> dict[str, str]:
    """Environment of the embedded nats-server only (the services are Python: Go settings are theirs)."""
    return {"GOMAXPROCS": str(nats_gomaxprocs(cores, setting))}
