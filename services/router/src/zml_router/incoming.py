"""What arrives at the router's request path: a NATS message, one out of the saturation queue, or
one whose body came in parts after it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol


class Incoming(Protocol):
    """An arriving request: a NATS message, or one out of the saturation queue (``QueuedMsg``)."""

    @property
    def subject(self) -> str: ...

    @property
    def data(self) -> bytes: ...

    @property
    def reply(self) -> str: ...

    @property
    def headers(self) -> dict[str, str] | None: ...


@dataclass(slots=True)
class QueuedMsg:
    """Quacks like a nats Msg for the router's request path."""

    subject: str
    data: bytes
    reply: str
    headers: dict[str, str]
    #: Resolved by the request path: True once a node has taken it, False if it found no room.
    placed: asyncio.Future[bool] | None = None
    #: Entries ranked before it in its holder's window when a slot was offered to it: with a
    #: backlog ahead it takes any free slot, not only its preferred node's
    #: (zmlcore.flowctl.gate.admit_flow's ``ahead``).
    ahead: int = 0


@dataclass(slots=True)
class Uploaded:
    """A request whose body came in parts after it (zml_router.request.uploads): the message as if it
    had carried the body."""

    subject: str
    data: bytes
    reply: str
    headers: dict[str, str] | None
