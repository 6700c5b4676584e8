"""`zml node-agent`: serve the node probe (GET /zml/v1/node) beside a serving engine.

Listed here for `zml --help`; `zml.cli.main` hands the arguments to ``zml_nodeagent``.
"""

from __future__ import annotations

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("node-agent", help="serve the node probe beside an engine (`zml node-agent --help`)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
