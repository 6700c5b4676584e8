"""Stopping tasks that run nats-py calls: cancel, and cancel again until they end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("zml.nats")


async def cancel_and_wait(tasks: "Iterable[asyncio.Future[Any]]", timeout: float = 5.0, every: float = 0.5) -> None:
    """Cancel background tasks and wait for them to end, cancelling again (each ``every``
    seconds) until they do, for at most ``timeout``.

    One cancel is not always enough on Python 3.11: ``asyncio.wait_for`` (used inside nats-py's
    connect, requests, JetStream fetches and KV calls) swallows a cancellation that lands just as
    its inner future completes, and the task's loop goes on (a connect tries the next server).
    Repeating the cancel lands it at the next await.
    """
    pending = {t for t in tasks if not t.done()}
    deadline = asyncio.get_running_loop().time() + timeout
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.warning("%d task(s) did not stop: %s", len(pending),
                        [t.get_name() if isinstance(t, asyncio.Task) else repr(t) for t in pending])
            return
        _, pending = await asyncio.wait(pending, timeout=min(every, left))
