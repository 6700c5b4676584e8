"""``python -m zml_health --config zml.toml [--nats-url URL]`` (``zml health``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    return service_parser("health", "ZML health service: polls nodes, streams their state")


def main(argv: list[str] | None = None) -> int:
    from zml_health.service import HealthService

    return service_main("health", build_parser().parse_args(argv), lambda cfg, _: HealthService(cfg))


if __name__ == "__main__":
    sys.exit(main())
