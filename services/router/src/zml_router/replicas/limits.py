"""Plan limits on raw NATS: a client identity given a plan (``zml creds issue NAME --plan ...``)
is limited by the router as the gateway limits an API key.

The plan is an ``identity.<public key>`` entry of the keys bucket (IdentityPlan), followed live
by every router: a change or removal applies within a second. The request's owner is the
identity whose reply inbox (``_ZML_INBOX.<public key>``) the request names, which the server's
permissions pin to the sender. Admission is :class:`~zmlcore.access.limiter.SharedLimiter` on the same
bucket, leases and arithmetic as the gateway's: every router replica counts into one entry, and an
identity that shares an API key's plan (``--key ID``) counts into that key's entry, so HTTP and
NATS together get the plan's rate, not twice it. An identity without a plan (and every service
identity, the gateway's included: its callers were limited at the gateway) is not limited here.

    limits = IdentityLimits(); await limits.start(nc)
    lease = await limits.admit(owner, request_id, lease_s=timeout)   # raises RateLimitError
    ...
    await limits.release(lease, tokens=123)   # before the last reply goes out
"""

from __future__ import annotations

import asyncio
import logging
import math
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.errors import RateLimitError
from zmlcore.access.apikeys import ENFORCED, IDENTITY_PREFIX
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.access.limiter import SharedLimiter
from zmlcore.messages.keys import ApiKeyRecord, IdentityPlan, PlanLimits, api_key_decoder, identity_plan_decoder
from zmlcore.access.plans import limited, refusal, verdict_headers
from zmlcore.runtime.runner import cancel_and_wait

log = logging.getLogger("zml.router.limits")


def rate_limited(message: str, *, retry_after: float, headers: dict[str, str]) -> RateLimitError:
    """RATE_LIMITED carrying the ``x-ratelimit-*`` values for the reply's NATS headers (an
    attribute, not a subclass: one error class per code)."""
    exc = RateLimitError(message, retry_after=retry_after)
    exc.nats_headers = headers  # type: ignore[attr-defined]
    return exc


@dataclass(slots=True)
class Lease:
    identity: str
    lease_id: str
    released: bool = False


#: The lease of the request this task handles (released before its last reply: release_current).
CURRENT: ContextVar[Lease | None] = ContextVar("zml_plan_lease", default=None)


class IdentityLimits:
    def __init__(self) -> None:
        self.plans: dict[str, IdentityPlan] = {}  # public key -> plan
        self.keys: dict[str, ApiKeyRecord] = {}  # API key id -> record (for shared plans)
        self.limiter: SharedLimiter | None = None
        self.follower: KVFollower | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, nc: NATS) -> None:
        self.limiter = await SharedLimiter.open(nc)
        self.follower = KVFollower(nc, subjects.KEYS_BUCKET, on_put=self.put_raw, on_delete=self.delete_raw)
        self._task = asyncio.create_task(self.follower.run())
        await self.follower.wait_ready(2.0)

    async def stop(self) -> None:
        await cancel_and_wait([self._task] if self._task is not None else [])
        if self.limiter is not None:
            await self.limiter.close()

    def put_raw(self, key: str, value: bytes) -> None:
        try:
            if key.startswith(IDENTITY_PREFIX):
                self.plans[key[len(IDENTITY_PREFIX):]] = identity_plan_decoder.decode(value)
            elif key != ENFORCED:
                self.keys[key] = api_key_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("bad entry %s in %s", key, subjects.KEYS_BUCKET)

    def delete_raw(self, key: str) -> None:
        if key.startswith(IDENTITY_PREFIX):
            self.plans.pop(key[len(IDENTITY_PREFIX):], None)
        else:
            self.keys.pop(key, None)

    def lookup(self, owner: str) -> tuple[str, str, PlanLimits, ApiKeyRecord | None] | None:
        """(limiter identity, plan name, limits, shared key record) of ``owner``; None: unlimited."""
        plan = self.plans.get(owner) if owner else None
        if plan is None:
            return None
        if plan.key_id:
            record = self.keys.get(plan.key_id)
            if record is None:  # the key was revoked: its plan went with it
                raise RateLimitError(f"identity {plan.name!r} shares the plan of API key {plan.key_id}, "
                                     "which is revoked", retry_after=60.0)
            return f"key:{record.id}", record.plan, record.limits, record
        return f"nats:{owner}", plan.plan, plan.limits, None

    def options(self, owner: str) -> ApiKeyRecord | None:
        """The shared API key's record (its label and default policy apply), if any."""
        plan = self.plans.get(owner) if owner else None
        return self.keys.get(plan.key_id) if plan is not None and plan.key_id else None

    async def admit(self, owner: str, request_id: str, lease_s: float) -> Lease | None:
        """Count one request of ``owner``; None when it has no plan. Raises RateLimitError."""
        found = self.lookup(owner)
        if found is None or self.limiter is None:
            return None
        identity, plan, limits, _ = found
        if not limited(limits):
            return None
        lease_id = f"nats-{owner[:12]}-{request_id}"  # never collides with a gateway's lease
        v = await self.limiter.acquire(identity, limits, lease_id=lease_id, lease_s=lease_s)
        if not v.ok:
            headers = dict(verdict_headers(v))
            headers["retry-after"] = str(max(1, math.ceil(v.retry_after_s)))
            raise rate_limited(refusal(plan, limits, v), retry_after=v.retry_after_s, headers=headers)
        return Lease(identity, lease_id)

    async def release(self, lease: Lease | None, tokens: int) -> None:
        """The request is over: its slot is free on every replica when this returns (see
        SharedLimiter.release). Once per lease; later calls do nothing."""
        if lease is not None and not lease.released and self.limiter is not None:
            lease.released = True
            await self.limiter.release(lease.identity, lease_id=lease.lease_id, tokens=tokens)

    async def release_current(self, tokens: int) -> None:
        """Release this task's lease (:data:`CURRENT`), if any."""
        lease = CURRENT.get()
        if lease is not None:
            CURRENT.set(None)
            await self.release(lease, tokens)
