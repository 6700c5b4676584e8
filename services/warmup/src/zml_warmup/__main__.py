"""``python -m zml_warmup --config zml.toml [--nats-url URL]`` (``zml warmup``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from zmlcore.config import load_config
from zmlcore.errors import ConfigError
from zmlcore.runner import install_uvloop, run_service
from zmlcore.telemetry import setup_logging, setup_tracing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zml warmup", description="ZML warmup service: pre-loads warm models in "
                                "quiet windows, keeps idle models warm, answers `zml serve`")
    p.add_argument("--config", help="path to zml.toml")
    p.add_argument("--nats-url", help="NATS URL (overrides zml.toml and ZML_NATS_URL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("warmup")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"zml warmup: {exc}", file=sys.stderr)
        return 2
    setup_tracing("zml-warmup")
    from zml_warmup.service import WarmupService

    install_uvloop()
    asyncio.run(run_service(WarmupService(cfg), args.nats_url or cfg.nats.url, "zml-warmup"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
