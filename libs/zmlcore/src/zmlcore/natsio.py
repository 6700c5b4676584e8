"""NATS plumbing shared by the services: connecting, and the KV buckets they rely on."""

from __future__ import annotations

import logging
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from zmlcore import subjects

log = logging.getLogger("zml.nats")


async def connect(url: str, name: str, *, connect_timeout: float = 2.0, **kwargs: Any) -> NATS:
    """Connect with reconnects forever: a broker restart must not kill a service."""

    async def _on_error(exc: Exception) -> None:
        log.warning("nats error: %s", exc)

    async def _on_disconnect() -> None:
        log.warning("nats disconnected")

    async def _on_reconnect() -> None:
        log.info("nats reconnected")

    return await nats.connect(
        url,
        name=name,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=_on_error,
        disconnected_cb=_on_disconnect,
        reconnected_cb=_on_reconnect,
        **kwargs,
    )


async def ensure_kv(js: JetStreamContext, bucket: str, *, history: int = 1) -> KeyValue:
    """Open a KV bucket, creating it on first use (every service may start first)."""
    try:
        return await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        pass
    try:
        return await js.create_key_value(KeyValueConfig(bucket=bucket, history=history))
    except Exception:  # created concurrently by another service: open it
        return await js.key_value(bucket)


async def nodes_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_kv(js, subjects.NODES_BUCKET)
