"""What a requester does when the broker answers "no responders" (sans-I/O).

A request published on ``zml.infer`` (or the gateway's front door) while no router is
subscribed gets the broker's status message ``503`` at once: nothing received it, so sending
it again is safe. That happens for a moment after a broker restart (the routers re-subscribe
a few tens of ms after the requesters reconnect) and while routers restart; failing those
requests would turn a blip into client-visible 503s. So the requester waits a short, growing
delay and sends again, for at most a grace period (and never past the request's own
deadline); a fleet with no router at all still gets the clean NO_HEALTHY_NODES after it.

:class:`NoRouterWait` decides; :class:`zmlcore.reply.exchange.Exchange` does the waiting and
sending. Time is an argument.

Example::

    wait = NoRouterWait(grace_s=2.0)
    ...on a "no responders" status at time now:
    delay = wait.delay(now, deadline)
    if delay is None: ...fail with NO_HEALTHY_NODES
    else: ...sleep delay (a client that goes away ends the wait), then publish again

>>> w = NoRouterWait(grace_s=1.0)
>>> [w.delay(t, deadline=10.0) for t in (0.0, 0.5, 0.75, 0.875, 0.9375, 1.0)]
[0.01, 0.02, 0.05, 0.1, 0.0625, None]
"""

from __future__ import annotations

#: Waits between sends, then the last one repeated: the first retries come quickly (routers
#: re-subscribe within ~0.1 s of a broker restart), later ones cost the broker little.
BACKOFF_S = (0.01, 0.02, 0.05, 0.1)
#: The status nats-py puts in the ``Status`` header of a "no responders" message.
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"


def is_no_responders(headers: dict[str, str] | None, data: bytes) -> bool:
    """The broker's "no responders" status message (empty, ``Status: 503``)."""
    return not data and headers is not None and headers.get(STATUS_HEADER) == NO_RESPONDERS


class NoRouterWait:
    """One request's waits for a router: each "no responders" asks :meth:`delay`."""

    __slots__ = ("grace_s", "since", "tries")

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: float | None = None  # the first "no responders"
        self.tries = 0

    def delay(self, now: float, deadline: float) -> float | None:
        """Seconds to wait before sending again, or None: give up (the grace since the first
        "no responders" is spent, or the request's ``deadline`` has come). The last wait is cut
        to end at the grace (or deadline) so the final attempt is made on time."""
        if self.since is None:
            self.since = now
        left = min(self.since + self.grace_s, deadline) - now
        if left <= 0:
            return None
        step = BACKOFF_S[min(self.tries, len(BACKOFF_S) - 1)]
        self.tries += 1
        return min(step, left)
