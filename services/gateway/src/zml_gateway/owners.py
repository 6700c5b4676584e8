"""Request-id ownership at the front door.

A request id belongs to whoever sent it: over HTTP, the API key (the ``Authorization`` value,
hashed so the key itself never travels on the bus) or, without one, the client address. The
gateway sends that owner as ``Zml-Owner`` on the request and on its cancels, so two callers
using the same id never touch each other's request, and refuses a second request with an id the
same caller already has in flight (409 DUPLICATE_REQUEST_ID) before it reaches a router.
"""

from __future__ import annotations

import hashlib
from typing import Any

from zmlcore import subjects
from zmlcore.errors import DuplicateRequestError


def http_owner(scope: dict[str, Any]) -> str:
    """``key:<hash>`` of the Authorization header, else ``addr:<client address>``."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return "key:" + hashlib.sha256(value).hexdigest()[:24]
    client = scope.get("client")
    return f"addr:{client[0] if client else '-'}"


class InFlight:
    """The (owner, request id) pairs this gateway has in flight."""

    def __init__(self) -> None:
        self._held: set[tuple[str, str]] = set()

    def claim(self, scope: dict[str, Any], request_id: str, headers: dict[str, str]) -> tuple[str, str]:
        """Record the request (adds ``Zml-Owner`` to its NATS headers); DuplicateRequestError
        if this owner already has ``request_id`` in flight. Release it with :meth:`release`."""
        key = (http_owner(scope), request_id)
        if key in self._held:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight for this caller")
        self._held.add(key)
        headers[subjects.H_OWNER] = key[0]
        return key

    def release(self, key: tuple[str, str]) -> None:
        self._held.discard(key)

    def __len__(self) -> int:
        return len(self._held)
