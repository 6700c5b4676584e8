"""Who is calling and how much they may: API keys, plans, and the per-address fallback.

- A run-time key (``zml keys create``) carries a plan: its limits are shared by every gateway
  replica through :class:`~zmlcore.access.limiter.SharedLimiter` (one KV entry, spent through leases).
- A static zml.toml key, or an anonymous caller when no key is configured, is limited by
  ``[gateway] requests_per_minute`` in a token bucket of this replica. Anonymous callers are
  told apart by client address only: a made-up ``Authorization`` header is not an identity
  (rotating it gave a fresh bucket each time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from zmlcore.config import ZMLConfig
from zmlcore.errors import AuthError, PermissionDeniedError, RateLimitError
from zmlcore.access.apikeys import KeyRing, key_id_of
from zmlcore.access.limiter import SharedLimiter
from zmlcore.messages.keys import ApiKeyRecord
from zmlcore.access.plans import Verdict, limited, refusal, verdict_headers
from zml_gateway.ratelimit import TokenBucket

Headers = list[tuple[bytes, bytes]]


class RateLimited(Exception):
    def __init__(self, error: RateLimitError, headers: Headers) -> None:
        self.error = error
        self.headers = headers


@dataclass(slots=True)
class Caller:
    identity: str
    record: ApiKeyRecord | None = None
    leased: bool = field(default=False)


def _verdict_headers(v: Verdict) -> Headers:
    return [(k.encode(), val.encode()) for k, val in verdict_headers(v)]


class Access:
    def __init__(self, cfg: ZMLConfig, ring: KeyRing, limiter: SharedLimiter | None,
                 refresh: Callable[[str], Awaitable[bool]] | None = None) -> None:
        self.ring = ring
        #: Reads one key id from the bucket ahead of the ring's watch (KVFollower.refresh).
        self.refresh = refresh
        self.limiter = limiter
        self.rpm = cfg.gateway.requests_per_minute
        self.burst = float(cfg.gateway.request_burst or max(1, round((self.rpm or 0) / 60)))
        self.buckets: dict[str, TokenBucket] = {}

    async def authenticate(self, scope: dict) -> Caller:  # type: ignore[type-arg]
        if not self.ring.enabled:
            client = scope.get("client")
            return Caller(f"addr:{client[0] if client else ''}")
        for name, value in scope["headers"]:
            if name == b"authorization":
                caller = self._verify(value)
                if caller is None and self.refresh is not None:
                    # A key created a moment ago (`zml keys create`) that this gateway's watch
                    # has not delivered yet: its entry read once before the 401 (rate-limited).
                    key_id = key_id_of(value[7:]) if value[:7] == b"Bearer " else None
                    if key_id is not None and key_id not in self.ring.records and await self.refresh(key_id):
                        caller = self._verify(value)
                if caller is not None:
                    return caller
                break
        raise AuthError("invalid, revoked or missing API key: send `Authorization: Bearer <key>` (ZML_API_KEY)")

    def _verify(self, authorization: bytes) -> Caller | None:
        found = self.ring.verify(authorization)
        if isinstance(found, ApiKeyRecord):
            return Caller(f"key:{found.id}", found)
        return Caller(found) if found is not None else None

    @staticmethod
    def check_model(caller: Caller, asked: str, canonical: str) -> None:
        allowed = caller.record.models if caller.record is not None else None
        if allowed and asked not in allowed and canonical not in allowed:
            raise PermissionDeniedError(f"this API key may not use model {canonical!r}")

    async def admit(self, caller: Caller, request_id: str, lease_s: float) -> Headers:
        """Count one request; the x-ratelimit-* headers to send. Raises RateLimited."""
        record = caller.record
        if record is not None:
            limits = record.limits
            if self.limiter is None or not limited(limits):
                return []
            v = await self.limiter.acquire(caller.identity, limits, lease_id=request_id, lease_s=lease_s)
            headers = _verdict_headers(v)
            if not v.ok:
                raise RateLimited(RateLimitError(refusal(record.plan, limits, v), retry_after=v.retry_after_s),
                                  [*headers, (b"retry-after", str(max(1, math.ceil(v.retry_after_s))).encode())])
            caller.leased = True
            return headers
        return self._local(caller)

    def _local(self, caller: Caller) -> Headers:
        if self.rpm is None:
            return []
        now = time.monotonic()
        bucket = self.buckets.get(caller.identity)
        if bucket is None:
            if len(self.buckets) > 10_000:  # forget callers whose buckets have refilled
                self.buckets = {k: b for k, b in self.buckets.items() if b.take(now, 0)[2] > 0}
            bucket = self.buckets[caller.identity] = TokenBucket(self.rpm / 60.0, self.burst, now)
        ok, remaining, reset = bucket.take(now)
        headers = [
            (b"x-ratelimit-limit-requests", str(self.rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(remaining).encode()),
            (b"x-ratelimit-reset-requests", f"{reset:.3f}s".encode()),
        ]
        if not ok:
            raise RateLimited(RateLimitError(f"more than {self.rpm} requests/minute for this key: retry in {reset:.1f} s",
                                             retry_after=reset),
                              [*headers, (b"retry-after", str(max(1, math.ceil(reset))).encode())])
        return headers

    async def release(self, caller: Caller, request_id: str, tokens: int) -> None:
        """The request is over: its plan's slot is free on every replica when this returns
        (SharedLimiter.release). Called before the response's last message; once per request."""
        if caller.leased and self.limiter is not None:
            caller.leased = False
            await self.limiter.release(caller.identity, lease_id=request_id, tokens=tokens)
