#!/usr/bin/env python3
"""The gateway's key check per request, in process: ``Access.authenticate`` (async since
7908bb4, for the read-ahead of a key the gateway's watch has not delivered yet) beside a copy of
the synchronous check it replaced, alternated in one run; medians of the repetitions.

    python benches/authenticate_cost.py [--calls 200000] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from zmlcore.access.apikeys import KeyRing
from zmlcore.config import parse_config
from zmlcore.errors import AuthError
from zmlcore.messages.keys import ApiKeyRecord
from zml_gateway.access import Access, Caller

KEY = "sk-static-1"
SCOPE = {"headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())],
         "client": ("127.0.0.1", 1)}


def sync_check(access: Access, scope: dict[str, Any]) -> Caller:
    """``Access.authenticate`` as it was before 7908bb4 (the baseline)."""
    if not access.ring.enabled:
        client = scope.get("client")
        return Caller(f"addr:{client[0] if client else ''}")
    for name, value in scope["headers"]:
        if name == b"authorization":
            found = access.ring.verify(value)
            if isinstance(found, ApiKeyRecord):
                return Caller(f"key:{found.id}", found)
            if found is not None:
                return Caller(found)
            break
    raise AuthError("invalid key")


async def main(calls: int, reps: int) -> None:
    access = Access(parse_config({"gateway": {"api_keys": [KEY]}}), KeyRing([KEY]), None)
    old, new = [], []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            sync_check(access, SCOPE)
        old.append((time.perf_counter() - t) / calls * 1e9)
        t = time.perf_counter()
        for _ in range(calls):
            await access.authenticate(SCOPE)
        new.append((time.perf_counter() - t) / calls * 1e9)
    ratios = [n / o for n, o in zip(new, old)]
    print(f"sync check {statistics.median(old):.0f} ns, authenticate {statistics.median(new):.0f} ns, "
          f"ratio median {statistics.median(ratios):.3f} (of {reps})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    asyncio.run(main(a.calls, a.reps))
