"""The live stack of the flow-control tests, one record for all of them
(tests/e2e/test_flow_control.py, tests/chaos/flowkill.py and benches/flow_chaos.py): two routers,
one MI300X sim of 4 sequence slots at 20x real time, ``[flow] hold_when_full``, keys allowed up to
``critical``, and a policy that queues on saturation (``"policy": "queued"`` in a body).
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MODEL, Stack, launch_stack

FLEET = [("mi300x-1", "amd_mi300x", [MODEL])]
FLOW = """
[flow]
max_priority = "critical"
hold_when_full = true

[policy.queued]
strategy = "latency"
queue_on_saturation = true
max_queue_ms = 20000
"""
SIM = "max_concurrency = 4\n"
#: the node's sequence slots (SIM)
SLOTS = 4
ROUTERS = ("router-1", "router-2")


def launch(nats_url: str, tmp: Path) -> Stack:
    """The stack, started (``Stack.stop`` ends it)."""
    return launch_stack(nats_url, tmp, fleet=FLEET, routers=len(ROUTERS), extra=FLOW, sim_extra=SIM)


def body(max_tokens: int, stream: bool = False) -> bytes:
    """A chat request for the stack's model, on the policy that queues."""
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                       "max_tokens": max_tokens, "policy": "queued", "stream": stream}).encode()
