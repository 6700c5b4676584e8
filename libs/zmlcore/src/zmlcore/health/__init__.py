"""Health logic shared by the health service, the routers and tools (pure, no I/O), plus the
run-time node registration client (:mod:`zmlcore.health.registry`)."""

from zmlcore.health.hardware import HardwareCheck, validate_hardware
from zmlcore.health.score import health_score

__all__ = ["HardwareCheck", "health_score", "validate_hardware"]
