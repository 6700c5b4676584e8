"""``python -m zml_batch --config zml.toml [--nats-url URL]`` (``zml batch-runner``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.runtime.runner import service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("batch", "ZML batch runner: runs the Batch API's batches (/v1/batches) on the fleet's spare "
                       "capacity; any number of runners share the work")
    p.prog = "zml batch-runner"
    p.add_argument("--runner-id", help="this runner's name in logs (default: random)")
    return p


def main(argv: list[str] | None = None) -> int:
    from zml_batch.service import BatchRunner

    return service_main("batch", build_parser().parse_args(argv),
                        lambda cfg, args: BatchRunner(cfg, getattr(args, "runner_id", None)))


if __name__ == "__main__":
    sys.exit(main())
