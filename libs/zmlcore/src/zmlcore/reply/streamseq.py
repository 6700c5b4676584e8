"""Sequence numbers on streamed replies: the receiver's check (pure).

Core NATS delivers at most once: a chunk published while the broker restarts is gone, and
the stream would reach the caller shorter than the node wrote it, with nothing to say so.
The router therefore numbers every message of a streamed reply in the ``Zml-Seq`` header
(``start`` 0, then each chunk and the final ``end`` 1, 2, ...). The gateway and the SDK's
NATS transport feed each message's header to a :class:`SeqCheck`; a number out of order
ends the stream with STREAM_INTERRUPTED. An ``end`` that never comes is the caller's timeout.

Example::

    check = SeqCheck()
    for msg in messages:
        gap = check.gap(msg.headers.get(subjects.H_SEQ))
        if gap:
            raise StreamInterruptedError(gap)
"""

from __future__ import annotations


class SeqCheck:
    """Expects 0, 1, 2, ... ; messages without a number (an older router) are not checked.

    >>> c = SeqCheck()
    >>> [c.gap(s) for s in ("0", "1", "3")]
    [None, None, 'stream message 2 was lost (next one received: 3)']
    """

    __slots__ = ("expected",)

    def __init__(self) -> None:
        self.expected = 0

    def gap(self, value: str | None) -> str | None:
        """None if ``value`` is the next number (or absent), else what went missing."""
        if value is None:
            return None
        try:
            n = int(value)
        except ValueError:
            return f"stream message with an invalid sequence number {value[:20]!r}"
        if n != self.expected:
            if n > self.expected:
                lost = f"{self.expected}" if n == self.expected + 1 else f"{self.expected}-{n - 1}"
                return f"stream message {lost} was lost (next one received: {n})"
            return f"stream message {n} arrived twice or out of order (expected {self.expected})"
        self.expected = n + 1
        return None

    def gap_n(self, n: int) -> str | None:
        """:meth:`gap` for a number already parsed (a header-less frame's, zmlcore.reply.streamframe)."""
        if n == self.expected:
            self.expected = n + 1
            return None
        return self.gap(str(n))
