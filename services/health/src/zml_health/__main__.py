"""``python -m zml_health --config zml.toml [--nats-url URL]`` (``zml health``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runtime.lease import lease_ttl_s
from zmlcore.runtime.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("health", "ZML health service: polls nodes, streams their state")
    p.add_argument("--ha", action="store_true", help="one of several replicas: active only while holding the "
                                                     "leader lease (KV zml_leases), standby otherwise")
    return p


def main(argv: list[str] | None = None) -> int:
    from zml_health.service import HealthService

    # With --ha, any number of replicas, one active: a leader lease renewed several times per poll, so a
    # standby takes over within about two polls (zmlcore.runtime.lease).
    return service_main("health", build_parser().parse_args(argv), lambda cfg, _: HealthService(cfg),
                        lease_ttl=lambda cfg: lease_ttl_s(cfg.health.poll_interval_s))


if __name__ == "__main__":
    sys.exit(main())
