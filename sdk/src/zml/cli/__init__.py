"""The ``zml`` command. Each sub-command lives in its own module with a ``register``
function adding its parser; this module only dispatches and turns ZML errors into one line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules providing `register(subparsers)`; each sets `func(args) -> int` on its parser.
_COMMANDS = (
    "zml.cli.up",
    "zml.cli.services",
    "zml.cli.sim",
    "zml.cli.infer",
    "zml.cli.batch",
    "zml.cli.batches",
    "zml.cli.bench",
    "zml.cli.nodes",
    "zml.cli.cost",
    "zml.cli.keys",
    "zml.cli.serve",
    "zml.cli.plan",
    "zml.cli.warmup",
    "zml.cli.node_agent",
    "zml.cli.creds",
    "zml.cli.why",
)


_PASSTHROUGH = {
    "sim": "zml_sim.cli",
    "gateway": "zml_gateway.__main__",
    "router": "zml_router.__main__",
    "health": "zml_health.__main__",
    "warmup": "zml_warmup.__main__",
    "batch-runner": "zml_batch.__main__",
    "node-agent": "zml_nodeagent.__main__",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zml", description="ZML: route LLM inference across accelerator fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Commands that run a service hand their arguments to its own parser untouched.
    if args_list and args_list[0] in _PASSTHROUGH:
        module = importlib.import_module(_PASSTHROUGH[args_list[0]])
        return int(module.main(args_list[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(args_list)
    from zmlcore.errors import ZMLError

    try:
        return int(args.func(args) or 0)
    except ZMLError as exc:
        print(f"zml: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
