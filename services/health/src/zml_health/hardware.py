"""Hardware validation: a node's reported hardware (``GET /zml/v1/node``) against its declared
accelerator type and the type's minimum driver (the API reference's table). Pure.

Example::

    check = validate_hardware("nvidia_h100", {"accelerator_type": "nvidia_h100",
                                              "driver_version": "520.61.05", "device_count": 8})
    assert not check.ok and "older than the minimum 525.85" in check.reason
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zmlcore.fleet.accelerators import ACCELERATORS, driver_ok


@dataclass(frozen=True, slots=True)
class HardwareCheck:
    """``ok`` False keeps the node out of routing (status "invalid", ``reason``); ``note`` is
    shown but does not stop routing."""

    ok: bool
    reason: str = ""
    note: str = ""


NO_PROBE_NOTE = "no node probe (GET /zml/v1/node): hardware not validated"


def validate_hardware(declared: str, doc: Mapping[str, Any] | None, *, strict: bool = False,
                      probe_url: str = "") -> HardwareCheck:
    """Check the node probe document ``doc`` (None: the node has no probe endpoint)."""
    acc = ACCELERATORS[declared]
    if doc is None:
        where = f" at {probe_url}" if probe_url else ""
        if strict:
            return HardwareCheck(False, f"no node probe{where}: run `zml node-agent` beside the engine "
                                        "(or set [health] require_node_probe = false)")
        return HardwareCheck(True, note=NO_PROBE_NOTE)
    reported = str(doc.get("accelerator_type") or "")
    if not reported:
        return HardwareCheck(False, "the node probe reports no accelerator (no devices found by the agent)")
    if reported != declared:
        known = ACCELERATORS[reported].hardware if reported in ACCELERATORS else ""
        name = str(doc.get("product_name") or known)
        return HardwareCheck(False, f"declared {declared} ({acc.hardware}) but the node reports {reported}"
                                    + (f" ({name})" if name and name != reported else ""))
    count = doc.get("device_count")
    if isinstance(count, int) and count < 1:
        return HardwareCheck(False, "the node probe reports no devices")
    driver = str(doc.get("driver_version") or "")
    if not driver:
        if strict:
            return HardwareCheck(False, f"the node probe reports no driver version (need {acc.driver_label})")
        return HardwareCheck(True, note=f"driver version unknown (need {acc.driver_label})")
    if not driver_ok(declared, driver):
        return HardwareCheck(False, f"driver {driver} is older than the minimum {acc.min_driver} "
                                    f"({acc.driver_label}) for {declared}")
    return HardwareCheck(True)
