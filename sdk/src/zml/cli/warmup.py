"""`zml warmup`: run the warmup service (listed here for `zml --help`).

`zml.cli.main` hands the arguments to the service's own parser (``zml_warmup.__main__``).
"""

from __future__ import annotations

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("warmup", help="run the warmup service (`zml warmup --help`)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
