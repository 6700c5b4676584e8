"""``python -m zml_warmup --config zml.toml [--nats-url URL]`` (``zml warmup``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    return service_parser("warmup", "ZML warmup service: pre-loads warm models in quiet windows, keeps idle "
                          "models warm, answers `zml serve`")


def main(argv: list[str] | None = None) -> int:
    from zml_warmup.service import WarmupService

    return service_main("warmup", build_parser().parse_args(argv), lambda cfg, _: WarmupService(cfg))


if __name__ == "__main__":
    sys.exit(main())
