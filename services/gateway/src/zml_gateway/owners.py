"""Request-id ownership at the front door.

A request id belongs to whoever sent it: over HTTP, the caller the gateway authenticated (its
API key id, or the client address without keys; ``Access.authenticate``). The gateway sends that
owner as ``Zml-Owner`` on the request and on its cancels, so two callers using the same id never
touch each other's request, and refuses a second request with an id the same caller already has
in flight (409 DUPLICATE_REQUEST_ID) before it reaches a router. That check is this replica's;
across gateway replicas (one identity, so one owner on the bus) the routers' shared claim refuses
the duplicate (zml_router.replicas.ids), and the gateway relays that 409.
"""

from __future__ import annotations

from zmlcore import subjects
from zmlcore.errors import DuplicateRequestError


class InFlight:
    """The (owner, request id) pairs this gateway has in flight."""

    def __init__(self) -> None:
        self._held: set[tuple[str, str]] = set()

    def claim(self, owner: str, request_id: str, headers: dict[str, str]) -> tuple[str, str]:
        """Record the request (adds ``Zml-Owner`` to its NATS headers); DuplicateRequestError
        if ``owner`` already has ``request_id`` in flight. Release it with :meth:`release`."""
        key = (owner, request_id)
        if key in self._held:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in flight for this caller")
        self._held.add(key)
        headers[subjects.H_OWNER] = owner
        return key

    def release(self, key: tuple[str, str]) -> None:
        self._held.discard(key)

    def __len__(self) -> int:
        return len(self._held)
