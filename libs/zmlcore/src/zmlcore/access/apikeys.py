"""API keys created at run time, stored hashed in the KV bucket ``zml_keys``.

A key is ``zml_<id>_<secret>``: 12 hex characters of id (listed, revoked, put in logs) and 32
random bytes of secret. The bucket holds the SHA-256 of the whole key, never the key; the key is
shown once, by ``zml keys create``. A high-entropy key needs no slow hash (there is nothing to
brute-force), and verifying is one SHA-256 plus a constant-time compare.

    key, record = await create_key(nc, plan="team", name="ci")
    ring = KeyRing(); task = asyncio.create_task(ring.follower(nc).run())
    record = ring.verify(b"Bearer " + key.encode())   # None: unknown or revoked
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
import typing

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.config import Priority
from zmlcore.errors import BadRequestError
from zmlcore.bus.kvfollow import KVFollower, live_entries
from zmlcore.messages.keys import ApiKeyRecord, IdentityPlan, PlanLimits, api_key_decoder
from zmlcore.bus.ensure import ensure_kv

log = logging.getLogger("zml.keys")

_PREFIX = "zml"
#: Written with the first run-time key and never by revoke: revoking the last key must not turn
#: authentication off (an empty ring would mean "no keys configured": open).
ENFORCED = "_enforced"
#: Entries ``identity.<public key>``: a NATS client identity's plan (IdentityPlan), for routers.
IDENTITY_PREFIX = "identity."
#: Unknown key ids a gateway reads from the bucket per second before answering 401 (a key
#: created a moment ago that its watch has not delivered yet).
KEY_READS_PER_S = 32


def hash_key(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def new_key() -> tuple[str, str]:
    """(key id, full key)."""
    key_id = secrets.token_hex(6)
    return key_id, f"{_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(key: bytes) -> str | None:
    """The id part of a key in our format, else None (static zml.toml keys have any form)."""
    parts = key.split(b"_", 2)
    if len(parts) == 3 and parts[0] == _PREFIX.encode() and len(parts[1]) == 12:
        try:
            return parts[1].decode("ascii")
        except UnicodeDecodeError:
            return None
    return None


async def keys_kv(nc: NATS) -> KeyValue:
    return await ensure_kv(nc.jetstream(), subjects.KEYS_BUCKET)


async def create_key(nc: NATS, *, plan: str, limits: PlanLimits, name: str = "", models: list[str] | None = None,
                     default_policy: str = "", label: str = "", priority: str = "", max_priority: str = "",
                     weight: float = 1.0) -> tuple[str, ApiKeyRecord]:
    """Store a new key's hash; returns the key (to show once) and its record."""
    if len(name) > 200 or len(label) > 200:
        raise BadRequestError("name and label are at most 200 characters")
    bands = typing.get_args(Priority)
    for what, band in (("priority", priority), ("max priority", max_priority)):
        if band and band not in bands:
            raise BadRequestError(f"unknown {what} {band!r}: one of {', '.join(bands)}")
    if not 0 < weight <= 1e6:
        raise BadRequestError(f"weight must be in (0, 1e6], got {weight:g}")
    key_id, key = new_key()
    record = ApiKeyRecord(id=key_id, sha256=hash_key(key), name=name, plan=plan, limits=limits,
                          models=list(models or []), default_policy=default_policy, label=label,
                          created_at=time.time(), priority=priority, max_priority=max_priority, weight=weight)
    kv = await keys_kv(nc)
    await kv.put(ENFORCED, b"1")
    await kv.create(key_id, msgspec.json.encode(record))
    return key, record


async def list_keys(nc: NATS) -> list[ApiKeyRecord]:
    """Every API key, oldest first (one snapshot of the bucket)."""
    entries = await live_entries(await keys_kv(nc), nc)
    out = [api_key_decoder.decode(value) for key_id, value in entries.items()
           if value and key_id != ENFORCED and not key_id.startswith(IDENTITY_PREFIX)]
    return sorted(out, key=lambda r: r.created_at)


async def revoke_key(nc: NATS, key_id: str) -> bool:
    """Delete the key's record; every gateway drops it as soon as its watch delivers the delete."""
    kv = await keys_kv(nc)
    if key_id == ENFORCED or key_id.startswith(IDENTITY_PREFIX):
        return False
    try:
        await kv.get(key_id)
    except KeyNotFoundError:
        return False
    await kv.purge(key_id)
    return True


async def set_identity_plan(nc: NATS, plan: IdentityPlan) -> None:
    """Give a NATS identity a plan (or change it): every router applies it within a second."""
    if plan.key_id:
        try:
            await (await keys_kv(nc)).get(plan.key_id)
        except KeyNotFoundError:
            raise BadRequestError(f"no API key {plan.key_id!r} to share a plan with") from None
    await (await keys_kv(nc)).put(IDENTITY_PREFIX + plan.public_key, msgspec.json.encode(plan))


async def remove_identity_plan(nc: NATS, public_key: str) -> bool:
    """The identity is no longer limited by a plan (its entry purged); False if it had none."""
    kv = await keys_kv(nc)
    try:
        await kv.get(IDENTITY_PREFIX + public_key)
    except KeyNotFoundError:
        return False
    await kv.purge(IDENTITY_PREFIX + public_key)
    return True


class KeyRing:
    """The keys a gateway accepts: the bucket's (followed live) and zml.toml's static ones."""

    def __init__(self, static: list[str] | None = None) -> None:
        self.records: dict[str, ApiKeyRecord] = {}
        self.static = {hash_key(f"Bearer {k}"): f"static-{hash_key(k)[:12]}" for k in static or []}
        self.enforced = False

    @property
    def enabled(self) -> bool:
        return self.enforced or bool(self.records or self.static)

    def verify(self, authorization: bytes) -> ApiKeyRecord | str | None:
        """The record of a run-time key, the id of a static key, or None. Both compares are
        constant-time over the hash (the lookup by id reveals only whether an id exists)."""
        if authorization[:7] == b"Bearer ":
            key_id = key_id_of(authorization[7:])
            if key_id is not None:
                record = self.records.get(key_id)
                if record is not None and hmac.compare_digest(hash_key(authorization[7:]), record.sha256):
                    return record
        digest = hash_key(authorization)
        for static_hash, static_id in self.static.items():
            if hmac.compare_digest(digest, static_hash):
                return static_id
        return None

    def follower(self, nc: NATS) -> KVFollower:
        """The bucket's follower feeding this ring (run it as a task): it survives broker
        restarts, so a revoke is never missed for long."""
        # refresh (a key unknown here read once before a 401) is open to anyone who can send a
        # header: a few distinct ids a second, not the default 1,024.
        return KVFollower(nc, subjects.KEYS_BUCKET, on_put=self.put_raw, on_delete=self.delete_raw,
                          refresh_limit=KEY_READS_PER_S)

    def put_raw(self, key: str, value: bytes) -> None:
        if key.startswith(IDENTITY_PREFIX):  # a NATS identity's plan: the routers' business
            return
        if key == ENFORCED:
            self.enforced = True
            return
        try:
            self.records[key] = api_key_decoder.decode(value)
        except msgspec.DecodeError:
            log.warning("bad api key record %s", key)

    def delete_raw(self, key: str) -> None:
        if key == ENFORCED:
            self.enforced = False
        elif self.records.pop(key, None) is not None:
            log.info("api key %s revoked", key)
