"""Liveness for supervisors that see a service only from outside (compose healthchecks).

A service started with ``--alive-file PATH`` touches PATH every :data:`BEAT_S` seconds while
its event loop turns and its NATS connection is up; a wedged loop or a lost broker stops the
beat. The check, run by the supervisor:

    python -m zmlcore.runtime.alive /tmp/zml-alive --max-age 10    # exit 0: alive, 1: not
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

BEAT_S = 2.0


async def beat(path: str, connected: Callable[[], bool]) -> None:
    """Touch ``path`` every BEAT_S seconds while ``connected()``; run as a task."""
    p = Path(path)
    while True:
        if connected():
            try:
                p.touch()
            except OSError:
                pass  # a full or read-only disk must not kill the service; the check will fail
        await asyncio.sleep(BEAT_S)


def age(path: str, now: float | None = None) -> float:
    """Seconds since ``path`` was last touched (infinite if it does not exist)."""
    try:
        return (time.time() if now is None else now) - os.stat(path).st_mtime
    except OSError:
        return float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zmlcore.runtime.alive", description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--max-age", type=float, default=10.0, help="seconds (default 10)")
    args = p.parse_args(argv)
    a = age(args.path)
    if a <= args.max_age:
        return 0
    print(f"{args.path}: last beat {a:.1f} s ago (limit {args.max_age:g} s)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
