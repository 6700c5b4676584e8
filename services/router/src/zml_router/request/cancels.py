"""Cancels for requests this replica does not hold (sans-I/O: time is passed in).

A cancel goes to every replica (``zml.cancel.<id>`` is not a queue group). The one holding the
request aborts it; the others remember the id, because the request may not have arrived yet (a
cancel can overtake its request: different subjects, different connections) or may be waiting
in the saturation queue. A request whose id is remembered is answered CANCELLED as soon as it
is registered. Every replica keeps the id until ``ttl_s`` passes, so an id cancelled once is
refused for that long whichever replica its next use reaches (request ids are meant to be
unique); then it is forgotten: expired ids are dropped as new ones arrive, so the book holds
about one TTL's worth of cancels (a steady trickle never fills it), and it is bounded (a flood of
cancels costs memory once).
"""

from __future__ import annotations

from collections import OrderedDict


class CancelBook:
    def __init__(self, ttl_s: float = 60.0, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._at: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str, now: float) -> None:
        self._at[request_id] = now
        self._at.move_to_end(request_id)
        self._expire(now)
        while len(self._at) > self.max_entries:
            self._at.popitem(last=False)

    def _expire(self, now: float) -> None:
        # Oldest first (add moves an id to the end), so stop at the first one still live.
        while self._at:
            request_id, at = next(iter(self._at.items()))
            if now - at <= self.ttl_s:
                break
            del self._at[request_id]

    def seen(self, request_id: str, now: float) -> bool:
        """A cancel for ``request_id`` arrived within ``ttl_s``."""
        at = self._at.get(request_id)
        return at is not None and now - at <= self.ttl_s

    def take(self, request_id: str, now: float) -> bool:
        """Like :meth:`seen`, and forget it (the request is being answered CANCELLED)."""
        at = self._at.pop(request_id, None)
        return at is not None and now - at <= self.ttl_s

    def __len__(self) -> int:
        return len(self._at)
