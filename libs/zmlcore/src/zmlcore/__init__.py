"""zmlcore: what every ZML service and the SDK share (wire messages, subjects, config,
errors, policy maths, telemetry)."""

__version__ = "0.1.0"

from zmlcore import _lazyimports  # noqa: F401,E402  (before any service imports nats: see the module)
