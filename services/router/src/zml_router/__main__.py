"""``python -m zml_router --config zml.toml [--nats-url URL] [--router-id ID]`` (``zml router``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runtime.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("router", "ZML router (any number of replicas)")
    p.add_argument("--router-id", help="replica id (default: random)")
    return p


def main(argv: list[str] | None = None) -> int:
    from zml_router.service import RouterService

    # no_echo: a router applies its own in-flight counts locally; the broker need not echo them.
    return service_main("router", build_parser().parse_args(argv),
                        lambda cfg, args: RouterService(cfg, args.router_id), no_echo=True)


if __name__ == "__main__":
    sys.exit(main())
