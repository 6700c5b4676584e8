"""API keys' plans, applied to their batches (zmlcore.access): every answered line's tokens
count against the owning key's tokens per minute, shared with its interactive traffic
through the same limiter entry as the gateways'; while the key's tokens are spent, its
batches' lines wait. Batch lines do not count as requests or concurrent requests: a batch is
one job, and it must not lock its key out of interactive use.

    plans = await Plans.open(nc)
    wait = await plans.wait_s("key:abc")          # 0: lines may go
    await plans.count("key:abc", tokens=120)
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from zmlcore.access.apikeys import keys_kv
from zmlcore.access.limiter import SharedLimiter
from zmlcore.messages.keys import PlanLimits, api_key_decoder

log = logging.getLogger("zml.batch")
#: A key's plan is read again after this long (a changed plan applies within it).
REFRESH_S = 10.0
KEY_PREFIX = "key:"


class Plans:
    def __init__(self, kv: KeyValue, limiter: SharedLimiter) -> None:
        self.kv = kv
        self.limiter = limiter
        self._cache: dict[str, tuple[PlanLimits | None, float]] = {}

    @classmethod
    async def open(cls, nc: NATS) -> Plans:
        return cls(await keys_kv(nc), await SharedLimiter.open(nc))

    async def limits(self, owner: str) -> PlanLimits | None:
        """The token limit of the key owning a batch (None: not a run-time key, or no token limit)."""
        if not owner.startswith(KEY_PREFIX):
            return None
        cached = self._cache.get(owner)
        now = time.monotonic()
        if cached is not None and now - cached[1] < REFRESH_S:
            return cached[0]
        limits = None
        try:
            entry = await self.kv.get(owner[len(KEY_PREFIX):])
            if entry.value:
                plan = api_key_decoder.decode(entry.value).limits
                if plan.tokens_per_minute is not None:
                    limits = PlanLimits(tokens_per_minute=plan.tokens_per_minute)
        except KeyNotFoundError:
            pass  # a revoked key: its batch runs out its window without a plan to count into
        self._cache[owner] = (limits, now)
        return limits

    async def wait_s(self, owner: str) -> float:
        limits = await self.limits(owner)
        return 0.0 if limits is None else await self.limiter.tokens_wait(owner, limits)

    async def count(self, owner: str, tokens: int) -> None:
        limits = await self.limits(owner)
        if limits is not None:
            await self.limiter.add_tokens(owner, limits, tokens)

    async def close(self) -> None:
        await self.limiter.close()
