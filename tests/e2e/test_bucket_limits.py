"""Every JetStream bucket and stream ZML creates is bounded: either its entries expire
(``max_age`` / KV ``ttl``) or it keeps one entry per key in a key space that ZML itself bounds
(one per node, per API key). A new bucket without a bound fails here (the soak's nats-server
must not grow with traffic)."""

from __future__ import annotations

from typing import Any

import nats

from zmlcore import subjects
from zmlcore.fleet.costs import costs_kv
from zmlcore.access.apikeys import keys_kv
from zmlcore.runtime.lease import Lease
from zmlcore.access.limiter import SharedLimiter

#: Buckets keyed by something ZML bounds (a node id, an API key id), one entry per key.
ONE_PER_KEY = {subjects.NODES_BUCKET, subjects.COSTS_BUCKET, subjects.REGISTRY_BUCKET, subjects.KEYS_BUCKET}


def _zml_bucket(stream: str) -> str | None:
    for prefix in ("KV_", "OBJ_"):
        if stream.startswith(prefix):
            return stream[len(prefix):]
    return None


async def test_every_bucket_and_stream_zml_creates_is_bounded(zml_stack: Any) -> None:
    nc = await nats.connect(zml_stack.nats_url)
    try:
        # The ones created on first use, which a plain stack may not have touched yet.
        await SharedLimiter.open(nc)
        await Lease(nc, "bounds-test", ttl_s=5.0)._bucket()
        await keys_kv(nc)
        await costs_kv(nc)
        js = nc.jetstream()
        checked: set[str] = set()
        for info in await js.streams_info():
            cfg = info.config
            name = cfg.name or ""
            bucket = _zml_bucket(name)
            ours = (bucket or "").startswith("zml_") and not (bucket or "").startswith("zml_test")
            if not (ours or name == subjects.QUEUE_STREAM):
                continue
            checked.add(bucket or name)
            expires = (cfg.max_age or 0) > 0
            one_per_key = bucket in ONE_PER_KEY and cfg.max_msgs_per_subject == 1
            assert expires or one_per_key, f"{name}: no bound (max_age={cfg.max_age}, " \
                                           f"max_msgs_per_subject={cfg.max_msgs_per_subject})"
        assert {subjects.NODES_BUCKET, subjects.LIMITS_BUCKET, subjects.LEASES_BUCKET, subjects.KEYS_BUCKET,
                subjects.COSTS_BUCKET, subjects.REQUEST_IDS_BUCKET} <= checked, checked
    finally:
        await nc.close()
