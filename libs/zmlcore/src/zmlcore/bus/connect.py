"""NATS plumbing shared by the services: connecting, and the KV buckets they rely on."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.bus import natsinternals
from zmlcore.bus.link import Link, link_of, register, split_urls

log = logging.getLogger("zml.nats")


async def connect(urls: str | Sequence[str], name: str, *, connect_timeout: float = 2.0, replicas: int = 1,
                  **kwargs: Any) -> NATS:
    """Connect to any of ``urls`` (a list, or one comma-separated string) and reconnect forever:
    a broker restart must not kill a service. The client's :class:`~zmlcore.bus.link.Link` tells
    JetStream users about reconnects and the service about a close for good.

    Raises ConfigError before connecting when the installed nats-py lacks a private piece ZML
    cannot do without (:func:`zmlcore.bus.natsinternals.check`)."""
    natsinternals.check()
    link = Link(replicas=replicas)

    async def _on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    async def _on_disconnect() -> None:
        log.warning("nats disconnected")

    async def _on_reconnect() -> None:
        log.info("nats reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        link.bump()

    async def _on_closed() -> None:
        if not link.closing and nc.last_error is not None:
            log.error("nats connection closed for good: %s", nc.last_error)
        link.mark_closed()

    nc = await nats.connect(
        servers=split_urls(urls),
        name=name,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        error_cb=_on_error,
        disconnected_cb=_on_disconnect,
        reconnected_cb=_on_reconnect,
        closed_cb=_on_closed,
        **kwargs,
    )
    register(nc, link)
    return nc


async def ensure_kv(js: JetStreamContext, bucket: str, *, history: int = 1, ttl: float | None = None,
                    memory: bool = False, max_bytes: int | None = None) -> KeyValue:
    """Open a KV bucket, creating it on first use (every service may start first) with the
    connection's JetStream replicas (``[nats] replicas``); ``memory``: not kept on disk."""
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        pass
    replicas = link_of(natsinternals.client_of(js)).replicas
    try:
        return await js.create_key_value(KeyValueConfig(
            bucket=bucket, history=history, replicas=replicas, ttl=ttl, max_bytes=max_bytes,
            storage=StorageType.MEMORY if memory else None))
    except Exception:  # created concurrently by another service: open it
        return await js.key_value(bucket)


async def nodes_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_kv(js, subjects.NODES_BUCKET)
