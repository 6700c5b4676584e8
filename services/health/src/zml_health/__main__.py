"""``python -m zml_health --config zml.toml [--nats-url URL]``"""

from __future__ import annotations

import argparse
import asyncio
import sys

from zmlcore.config import load_config
from zmlcore.errors import ConfigError
from zmlcore.runner import install_uvloop, run_service
from zmlcore.telemetry import setup_logging, setup_tracing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zml health", description="ZML health service: polls nodes, streams their state")
    p.add_argument("--config", help="path to zml.toml")
    p.add_argument("--nats-url", help="NATS URL (overrides zml.toml and ZML_NATS_URL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("health")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"zml health: {exc}", file=sys.stderr)
        return 2
    setup_tracing("zml-health")
    from zml_health.service import HealthService

    install_uvloop()
    asyncio.run(run_service(HealthService(cfg), args.nats_url or cfg.nats.url, "zml-health"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
