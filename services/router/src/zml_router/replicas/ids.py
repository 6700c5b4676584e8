"""A caller's request id is in flight at most once, across every router replica.

Cancels and replies find a request by (owner, front-door owner, request id). One replica sees
only its own requests, and NATS hands two requests with the same id to two replicas (the queue
group, or two gateways), so each router *creates* an entry in the KV bucket
``zml_request_ids`` before dispatch. Create is refused when the key exists, on every replica
at once; the entry is deleted before the request's last reply goes out, so a caller that got its
answer may reuse the id at once.

- Only ids the caller chose need a claim: an id the gateway, the SDK or the router generated is
  unique by construction (``Zml-Id-Generated``) and skips the round trip.
- A request that waits in the saturation queue keeps its claim: its revision travels with it
  (``Zml-Id-Claim``) to whichever replica answers it, which deletes exactly that revision.
- A router that dies leaves its claims behind. Each has a TTL (the request's timeout plus
  :data:`SLACK_S`), and a replica that meets one asks the holder (``zml.admin.router.<id>.state``):
  no responders means it is gone, and the claim is taken over with compare-and-set. A claim
  names its holder's incarnation too (``router-1#9f3a0c1d``): a router restarted under the same
  id answers, but as another incarnation, so the dead one's claims are taken over at once
  instead of refusing its callers' retries until their TTL. A request
  resent after its router went silent (``Zml-Resend``, zmlcore.reply.keepalive) takes the claim over
  whoever holds it: its requester stopped listening to the first attempt, and it touches only
  its sender's own ids.
- The bucket is memory storage (claims are worthless after a broker restart) with a bounded
  size and age. If it cannot be reached, the replica's own check still holds and the request
  goes on (logged): a caller's duplicate ids harm only that caller.

    ids = RequestIds(router_id, max_timeout_s); await ids.open(nc)
    claim = await ids.claim(key, timeout_s)     # raises DuplicateRequestError
    ...
    await ids.release(claim)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from zmlcore import subjects
from zmlcore.errors import DuplicateRequestError
from zmlcore.bus.ensure import ensure_kv
from zmlcore.messages.router import router_state_decoder

log = logging.getLogger("zml.router.ids")

_EXPECT_LAST = "Nats-Expected-Last-Subject-Sequence"  # JetStream's compare-and-set header
#: A claim outlives its request's timeout by this much (the reply, the release, a queue hop).
SLACK_S = 10.0
#: How long the delete marker of a released claim stays (the server's smallest TTL).
MARKER_TTL_S = 1.0
#: Bucket bounds: nothing lives longer than the largest timeout allows; memory is capped.
BUCKET_MAX_BYTES = 64 * 1024 * 1024
#: How long to wait for a holder to say it is alive before calling the id a duplicate.
HOLDER_PING_S = 0.5
H_ID_CLAIM = subjects.H_ID_CLAIM


@dataclass(slots=True)
class Claim:
    key: str
    revision: int
    expires: float  # time.time() when the server removes it anyway


def bucket_key(key: str) -> str:
    """The KV key of a claim (a hash: ids may hold any allowed character). Computed only when
    a claim is taken or carried, not on every request."""
    return hashlib.sha256(key.encode()).hexdigest()[:40]


class RequestIds:
    """Claims of one router replica (``router_id``); keys are ``zml_router.request.intake.claim_key``.
    Usable before :meth:`open`: until then it claims and releases nothing."""

    def __init__(self, router_id: str, max_timeout_s: float, incarnation: str = "") -> None:
        self.nc: NATS | None = None
        self.router_id = router_id
        self.incarnation = incarnation
        #: what a claim of this replica holds (RouterState.incarnation: the process, not the id)
        self.holder = f"{router_id}#{incarnation}" if incarnation else router_id
        self.max_age_s = max_timeout_s + SLACK_S + 60.0
        self.kv: KeyValue | None = None
        self._pre = f"$KV.{subjects.REQUEST_IDS_BUCKET}."

    async def open(self, nc: NATS) -> None:
        self.nc = nc
        await self._bucket()

    async def _bucket(self) -> None:
        if self.nc is None:
            return
        try:
            self.kv = await ensure_kv(self.nc.jetstream(), subjects.REQUEST_IDS_BUCKET, ttl=self.max_age_s,
                                      memory=True, max_bytes=BUCKET_MAX_BYTES,
                                      wait_s=0)  # on a request's path: the next claim tries again
        except Exception:
            log.warning("bucket %s unavailable: duplicate ids are refused per replica only",
                        subjects.REQUEST_IDS_BUCKET, exc_info=True)

    async def claim(self, key: str, timeout_s: float, request_id: str, takeover: bool = False) -> Claim | None:
        """Take ``key`` for a request of ``timeout_s``; DuplicateRequestError if a live request
        holds it. None: the bucket could not be reached (the request goes on unclaimed).
        ``takeover``: the request was sent again because its router went silent (``Zml-Resend``):
        it takes the claim whoever holds it (it only touches its sender's own ids)."""
        if self.kv is None:
            await self._bucket()
            if self.kv is None:
                return None
        key = bucket_key(key)
        ttl = timeout_s + SLACK_S
        try:
            for _ in range(3):  # a marker or a dead holder in the way: one more try each
                try:
                    rev = await self._put(key, 0, ttl)
                    return Claim(key, rev, time.time() + ttl)
                except KeyWrongLastSequenceError:
                    pass
                try:
                    entry = await self.kv.get(key)
                    holder = (entry.value or b"").decode(errors="replace")
                    last = entry.revision or 0
                except KeyNotFoundError as err:  # a released claim's marker (or expired): write over it
                    marker = getattr(err, "entry", None)
                    holder, last = "", (marker.revision or 0) if marker is not None else 0
                if holder and not takeover:
                    if holder == self.holder or await self._alive(holder):
                        raise DuplicateRequestError(
                            f"request_id {request_id!r} is already in flight for this caller")
                    log.info("taking over the id claim of %s (no longer running)", holder)
                try:
                    rev = await self._put(key, last, ttl)
                    return Claim(key, rev, time.time() + ttl)
                except KeyWrongLastSequenceError:
                    continue  # someone else was faster: look again
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight for this caller")
        except (DuplicateRequestError, asyncio.CancelledError):
            raise
        except Exception:
            log.warning("request id claim failed; this replica's own check only", exc_info=True)
            return None

    async def release_current(self) -> None:
        """Release this task's claim (before its last reply: the caller may reuse the id at once)."""
        claim = CURRENT.get()
        if claim is not None:
            CURRENT.set(None)
            await self.release(claim)

    async def release(self, claim: Claim | None) -> None:
        """Delete the claim, if it is still this revision (its TTL may have handed it on)."""
        if claim is None or self.kv is None or self.nc is None or not self.nc.is_connected:
            return
        headers = {"KV-Operation": "DEL", _EXPECT_LAST: str(claim.revision)}
        try:
            await self.nc.jetstream().publish(self._pre + claim.key, b"", headers=headers, msg_ttl=MARKER_TTL_S)
        except KeyWrongLastSequenceError:
            pass  # expired and taken by a new request already: not ours to delete
        except Exception:  # it expires by itself
            log.debug("request id claim %s not released", claim.key, exc_info=True)

    async def _put(self, key: str, last: int, ttl: float) -> int:
        headers = {_EXPECT_LAST: str(last)}
        assert self.nc is not None  # a bucket was opened on it
        try:
            ack = await self.nc.jetstream().publish(self._pre + key, self.holder.encode(), headers=headers,
                                                    msg_ttl=max(1.0, ttl))
        except Exception as exc:
            if getattr(exc, "err_code", None) in (10071, 10164):  # wrong last sequence
                raise KeyWrongLastSequenceError from exc
            raise
        return ack.seq

    async def _alive(self, holder: str) -> bool:
        """Does the incarnation of a router that wrote ``holder`` still run? The router answers
        its state subject while it does, with its incarnation."""
        rid, _, incarnation = holder.partition("#")
        if not rid or self.nc is None:
            return False
        if rid == self.router_id:  # not this process's (that is self.holder): an earlier one's
            return not incarnation  # a claim without one: can't tell, refuse (the safe answer)
        try:
            reply = await self.nc.request(subjects.router_state(rid), b"", timeout=HOLDER_PING_S)
        except NoRespondersError:
            return False
        except (NatsTimeoutError, asyncio.TimeoutError):
            return True  # busy, not gone: refusing is the safe answer
        if not incarnation:
            return True
        try:
            now = router_state_decoder.decode(reply.data).incarnation
        except (msgspec.DecodeError, msgspec.ValidationError):
            return True
        return now in ("", incarnation)  # "" : a router that does not tell


#: The claim of the request this task is answering, released just before its last reply.
CURRENT: ContextVar[Claim | None] = ContextVar("zml_id_claim", default=None)


def queued_claim(key: str, headers: dict[str, str]) -> Claim | None:
    """The claim a queued request carries (taken by the replica where it arrived)."""
    try:
        rev = int(headers.get(H_ID_CLAIM, "") or 0)
    except ValueError:
        return None
    return Claim(bucket_key(key), rev, 0.0) if rev > 0 else None
