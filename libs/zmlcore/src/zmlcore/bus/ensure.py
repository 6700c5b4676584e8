"""JetStream assets (KV buckets, object stores, streams, durable consumers) opened, or created
on first use: any service may start first, several at once, and against a cluster that is still
electing its leaders.

One loop for all of them (``ensure``): open; if missing, create; if the create fails, open again
(another process created it meanwhile); while JetStream cannot answer, try again until ``wait_s``.
A cluster that has just formed has no meta leader for a second or so: a create sent then times
out and there is nothing to open, and a service that gave up at once would die at start."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.bus import natsinternals
from zmlcore.bus.link import link_of
from zmlcore.errors import ConnectionError as ZMLConnectionError

log = logging.getLogger("zml.nats")

T = TypeVar("T")

#: How long a service waits at start for JetStream to create what it needs.
WAIT_S = 20.0

_MISSING = (BucketNotFoundError, NotFoundError)


async def ensure(open_: Callable[[], Awaitable[T]], create: Callable[[], Awaitable[T]], what: str, *,
                 wait_s: float = WAIT_S) -> T:
    """``open_()`` (raising nats-py's not-found when missing), else ``create()``; what exists is
    left as it is (an operator may have configured it). ``wait_s`` 0: one attempt."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    delay = 0.1
    while True:
        failure: Exception | None = None
        try:
            return await open_()
        except _MISSING:
            pass
        except Exception as exc:  # JetStream not answering: try again below
            failure = exc
        if failure is None:
            try:
                return await create()
            except Exception as exc:  # created concurrently by another process, or not answering
                failure = exc
            try:  # created meanwhile by another process?
                return await open_()
            except Exception:  # still missing, or not answering: the create's error stands
                pass
        if loop.time() + delay > end:
            if isinstance(failure, ServiceUnavailableError):  # nobody answers the JetStream API
                raise ZMLConnectionError(
                    f"JetStream does not answer at this NATS server ({what}: 503 for {wait_s:g} s): run "
                    "nats-server with JetStream on (-js; `zml up` does); a cluster needs most of its servers up"
                ) from failure
            raise failure
        log.log(logging.DEBUG if delay < 1 else logging.WARNING, "%s not ready (%s: %s); retrying",
                what, type(failure).__name__, failure)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def ensure_kv(js: JetStreamContext, bucket: str, *, history: int = 1, ttl: float | None = None,
                    memory: bool = False, max_bytes: int | None = None, direct: bool = False,
                    wait_s: float = WAIT_S) -> KeyValue:
    """A KV bucket, created with the connection's JetStream replicas (``[nats] replicas``);
    ``memory``: not kept on disk; ``direct``: reads served by any replica."""
    replicas = link_of(natsinternals.client_of(js)).replicas
    config = KeyValueConfig(bucket=bucket, history=history, replicas=replicas, ttl=ttl, max_bytes=max_bytes,
                            storage=StorageType.MEMORY if memory else None, direct=direct)
    return await ensure(lambda: js.key_value(bucket), lambda: js.create_key_value(config), f"bucket {bucket}",
                        wait_s=wait_s)


async def nodes_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_kv(js, subjects.NODES_BUCKET)
