"""Header-less stream frames: a streamed reply's chunks for a requester that asked with
``Zml-Accept-Stream: frames`` (the gateway). Pure.

A chunk message then carries **no NATS headers**: its body is the sequence number in ASCII
decimal, a ``\\n``, and one or more whole SSE events exactly as the node framed them
(``data: <chunk JSON>\\n\\n`` each, never ``[DONE]``)::

    b"7\\ndata: {...}\\n\\n"

``start``, ``end``, ``error`` and keepalive messages keep their headers (``Zml-Stream``,
``Zml-Seq``, ``Zml-Keepalive``), so a header-less message on the reply subject is a frame and
nothing else. Why: per chunk, a header block costs the router its encoding and the receiver
nats-py's header parse and dict; a frame costs neither (docs/nats-api.md, "Streaming").

Example::

    data = encode(3, b"data: {}\\n\\n")          # b"3\\ndata: {}\\n\\n"
    seq, events = decode(data)                   # (3, b"data: {}\\n\\n")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zmlcore.errors import BackendError, StreamInterruptedError, ZMLError
from zmlcore.reply.streamseq import SeqCheck

#: A sequence number longer than this is not one (2**40 chunks is more than any stream).
MAX_SEQ_DIGITS = 12
#: :func:`collect` stops taking waiting frames past this many bytes (one write stays small).
MAX_COLLECT_BYTES = 64 * 1024


class FrameError(ValueError):
    """A header-less message on a stream's reply subject that is not a frame."""


def encode(seq: int, events: bytes) -> bytes:
    """The frame of chunk ``seq`` holding ``events`` (whole SSE events)."""
    return b"%d\n" % seq + events


def decode(data: bytes) -> tuple[int, bytes]:
    """``(seq, events)`` of a frame; FrameError for anything else (a garbled or foreign message).

    >>> decode(b"12\\ndata: x\\n\\n")
    (12, b'data: x\\n\\n')
    >>> decode(b"data: x\\n\\n")
    Traceback (most recent call last):
    ...
    zmlcore.reply.streamframe.FrameError: not a stream frame: b'data: x\\n\\n'
    """
    i = data.find(b"\n", 0, MAX_SEQ_DIGITS + 1)
    # bytes.isdigit is ASCII-only: no sign, space or non-ASCII digit gets through to int().
    if i <= 0 or not data[:i].isdigit() or not data.startswith(b"data:", i + 1):
        raise FrameError(f"not a stream frame: {data[:40]!r}")
    return int(data[:i]), data[i + 1:]


def collect(data: bytes, more: Callable[[], Any], seq: SeqCheck) -> tuple[bytes, ZMLError | None]:
    """The events of frame ``data`` and of the frames ``more()`` hands out after it (messages
    already waiting, None when there are no more; up to MAX_COLLECT_BYTES): one write for all. The error, if any, ends
    the stream: a frame lost (STREAM_INTERRUPTED) or a message that is not a frame
    (BACKEND_ERROR); the events before it are returned with it, to write first.

    >>> check = SeqCheck(); check.gap("0")  # the start message
    >>> from types import SimpleNamespace as M  # a nats Msg: only .data is read
    >>> waiting = iter([M(data=b"2\\ndata: b\\n\\n"), None])
    >>> collect(b"1\\ndata: a\\n\\n", waiting.__next__, check)
    (b'data: a\\n\\ndata: b\\n\\n', None)
    >>> collect(b"4\\ndata: d\\n\\n", waiting.__next__, check)[1].code
    'STREAM_INTERRUPTED'
    """
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            n, events = decode(data)
        except FrameError as exc:
            return b"".join(parts), BackendError(f"the router sent a garbled stream message ({exc}); "
                                                 "the stream is incomplete")
        gap = seq.gap_n(n)
        if gap is not None:
            return b"".join(parts), StreamInterruptedError(f"{gap}; the stream is incomplete")
        size += len(events)
        msg = more() if size < MAX_COLLECT_BYTES else None  # the rest: the caller's next read
        if msg is None:
            if not parts:
                return events, None
            parts.append(events)
            return b"".join(parts), None
        parts.append(events)
        data = msg.data
