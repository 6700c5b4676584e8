"""Replies larger than NATS's ``max_payload``: delivered through a JetStream object store.

A node's reply may be larger than one NATS message (1 MiB by default); publishing it failed
after the work was done. The router stores such a body in the object store ``zml_replies``
(chunked by JetStream, TTL a few minutes) and replies with an empty message carrying
``Zml-Reply-Object: <name>`` and the usual headers; whoever receives it fetches the body and
deletes the object. Both sides use this module.

    data, headers = await maybe_stash(nc, name, data, headers)    # router
    body = await fetch_reply(nc, msg)                              # gateway, SDK
"""

from __future__ import annotations

import contextlib

from nats.aio.client import Client as NATS
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore

from zmlcore import subjects

#: Room for headers when deciding whether a body fits in one message.
HEADER_ROOM = 4096
TTL_S = 300.0


async def _store(nc: NATS) -> ObjectStore:
    js = nc.jetstream()
    try:
        return await js.object_store(subjects.REPLIES_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        try:
            return await js.create_object_store(subjects.REPLIES_BUCKET, ObjectStoreConfig(ttl=TTL_S))
        except Exception:  # created meanwhile by another router
            return await js.object_store(subjects.REPLIES_BUCKET)


def fits(nc: NATS, data: bytes) -> bool:
    return len(data) + HEADER_ROOM <= (nc.max_payload or 1024 * 1024)


async def maybe_stash(nc: NATS, name: str, data: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    """``(data, headers)`` to publish: unchanged when they fit, else an empty body pointing at
    the stored object. ``name`` must be unique (request id + decision id)."""
    if fits(nc, data):
        return data, headers
    # Chunks must fit in a message too (nats-py's default, 128 KiB, may not).
    chunk = max(1024, min(128 * 1024, (nc.max_payload or 1024 * 1024) - HEADER_ROOM))
    await (await _store(nc)).put(name, data, meta=ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk)))
    return b"", {**headers, subjects.H_REPLY_OBJECT: name}


async def fetch_reply(nc: NATS, data: bytes, headers: dict[str, str] | None) -> bytes:
    """The reply body: ``data`` itself, or the stored object it points at (then deleted)."""
    name = (headers or {}).get(subjects.H_REPLY_OBJECT)
    if not name:
        return data
    store = await _store(nc)
    body = (await store.get(name)).data or b""
    with contextlib.suppress(Exception):
        await store.delete(name)
    return body
