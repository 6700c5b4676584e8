"""`zml sim`: listed here for --help; the arguments go to zml_sim.cli (see zml.cli.main)."""

from __future__ import annotations

import argparse


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("sim", help="run simulated accelerator nodes (`zml sim --help`)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
