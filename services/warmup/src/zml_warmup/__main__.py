"""``python -m zml_warmup --config zml.toml [--nats-url URL]`` (``zml warmup``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runtime.lease import lease_ttl_s
from zmlcore.runtime.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("warmup", "ZML warmup service: pre-loads warm models in quiet windows, keeps idle "
                       "models warm, answers `zml serve`")
    p.add_argument("--ha", action="store_true", help="one of several replicas: active only while holding the "
                                                     "leader lease (KV zml_leases), standby otherwise")
    return p


def main(argv: list[str] | None = None) -> int:
    from zml_warmup.service import WarmupService

    # With --ha, any number of replicas, one active: a leader lease renewed several times per sweep, so a
    # standby takes over within about two sweeps (zmlcore.runtime.lease).
    return service_main("warmup", build_parser().parse_args(argv), lambda cfg, _: WarmupService(cfg),
                        lease_ttl=lambda cfg: lease_ttl_s(cfg.warmup.sweep_interval_s))


if __name__ == "__main__":
    sys.exit(main())
