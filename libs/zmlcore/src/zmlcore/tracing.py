"""OpenTelemetry spans on ZML's request path (filled in by the tracing work)."""

from __future__ import annotations

#: True once zmlcore.telemetry.setup_tracing installed an exporting provider. The request path
#: tests this flag before touching OpenTelemetry, so tracing off costs one attribute read.
ON = False


def enable(on: bool = True) -> None:
    global ON
    ON = on
