"""How many requests wait in the saturation queue, per model key, read from JetStream's
consumer info (the router's metrics and the gateway's dashboard both show it)."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from zmlcore import subjects


async def queue_depths(nc: NATS, timeout: float = 1.0) -> dict[str, int]:
    """model key -> waiting + being dispatched; {} when the queue stream does not exist yet."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=timeout)
    try:
        infos = await js.consumers_info(subjects.QUEUE_STREAM)
    except NotFoundError:
        return {}
    depth: dict[str, int] = {}
    for ci in infos:
        fs = ci.config.filter_subject or ""
        if fs.startswith(subjects.QUEUE_SUBJECT_PREFIX + "."):
            depth[fs.rsplit(".", 1)[-1]] = int(ci.num_pending or 0) + int(ci.num_ack_pending or 0)
    return depth
