"""`zml gateway|router|health`: run one service alone (what compose.yaml and `zml up` run).

Listed here for `zml --help`; `zml.cli.main` hands the arguments to the service's own parser.
"""

from __future__ import annotations

import argparse

_SERVICES = {
    "gateway": "HTTP gateway (OpenAI-compatible)",
    "router": "router replica",
    "health": "health service",
    "batch-runner": "batch runner (the Batch API's work)",
}


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    for name, help_text in _SERVICES.items():
        p = sub.add_parser(name, help=f"run the {help_text} (`zml {name} --help`)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
