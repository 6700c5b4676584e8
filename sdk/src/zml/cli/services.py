"""`zml gateway|router|health`: run one service alone (what compose.yaml and `zml up` run)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

_SERVICES: dict[str, tuple[str, str]] = {
    "gateway": ("zml_gateway.__main__", "HTTP gateway (OpenAI-compatible)"),
    "router": ("zml_router.__main__", "router replica"),
    "health": ("zml_health.__main__", "health service"),
}


def _runner(module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        main: Callable[[list[str]], int] = importlib.import_module(module).main
        return main(args.rest)

    return run


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    for name, (module, help_text) in _SERVICES.items():
        p = sub.add_parser(name, help=f"run the {help_text} (`zml {name} --help`)", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_runner(module))
