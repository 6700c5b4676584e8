"""``python -m zml_router --config zml.toml [--nats-url URL] [--router-id ID]``"""

from __future__ import annotations

import argparse
import asyncio
import sys

from zmlcore.config import load_config
from zmlcore.errors import ConfigError
from zmlcore.runner import install_uvloop, run_service
from zmlcore.telemetry import setup_logging, setup_tracing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zml router", description="ZML router (any number of replicas)")
    p.add_argument("--config", help="path to zml.toml")
    p.add_argument("--nats-url", help="NATS URL (overrides zml.toml and ZML_NATS_URL)")
    p.add_argument("--router-id", help="replica id (default: random)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("router")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"zml router: {exc}", file=sys.stderr)
        return 2
    setup_tracing("zml-router")
    from zml_router.service import RouterService

    install_uvloop()
    asyncio.run(run_service(RouterService(cfg, args.router_id), args.nats_url or cfg.nats.url, "zml-router",
                            no_echo=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
