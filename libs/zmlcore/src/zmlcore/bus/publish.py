"""Publishing on the request path without nats-py's per-publish flush round trip.

nats-py 2.16's ``Client.publish`` encodes the headers (a regex match per key), appends the
command to the client's ``_pending`` list, then ``_flush_pending`` makes a Future, puts it on an
asyncio.Queue and the ``_flusher`` task wakes to ``writelines`` it and ``await drain()``: a
Future, a queue hand-off and a task switch per burst of publishes, on every reply, chunk and
request (~23% of the router's CPU in the profiles of docs/benchmarks.md).

:class:`Publisher` sends the same bytes (the header block is built as nats-py builds it, with
the checked key encodings cached) onto the same ``_pending`` list, and schedules one plain
callback per event-loop iteration (``loop.call_soon``) that writes everything pending in one
``writelines``: all publishes of one iteration, ours and nats-py's own (SUB, UNSUB, its
publishes), leave in one write and in the order they were made.

What stays nats-py's:

- anything but a connected client (reconnecting, draining, closed): ``nc.publish``, so its
  reconnect buffer, its bound on it and its errors apply unchanged;
- back-pressure: past ``pending_size`` bytes pending, nats-py's forced flush (it waits for the
  socket to drain); a socket over its high-water mark is written by nats-py's flusher, which
  awaits ``drain()``, never by the callback;
- validation: a subject or reply with a space, tab, CR or LF raises BadSubjectError, a header key
  that is not an RFC 7230 token raises BadHeaderError, CR/LF in a header value become spaces
  (exactly nats-py's rules: nothing can end a protocol line early).

nats-py's buffer (``_pending``, ``_transport``, ``_flush_queue``...) is reached only through
:mod:`zmlcore.bus.natsinternals`, which decides once per process whether this nats-py has it
(else every publish is ``nc.publish``, logged at start-up). tests/unit/test_publish_encode.py
pins the bytes against nats-py's own encoder.

Example::

    pub = Publisher.of(nc)
    await pub.publish(reply, data, headers={"Zml-Stream": "start"})
"""

from __future__ import annotations

import asyncio
import re
import weakref

from nats import errors
from nats.aio.client import Client as NATS

from zmlcore.bus import natsinternals

#: nats-py's own rules (nats/aio/client.py, 2.16): kept identical so both paths accept and
#: reject the same subjects and headers.
_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_HDR_LINE = b"NATS/1.0\r\n"
_CRLF = b"\r\n"
_EMPTY_BLOCK = _HDR_LINE + _CRLF
#: Header keys whose checked encoding is remembered: ours are a few dozen constants.
MAX_CACHED_KEYS = 512

_keys: dict[str, str] = {}


def _key(k: str) -> str:
    """``"Key: "`` for a header key ("" for a blank one, which nats-py skips); BadHeaderError
    for anything that is not a token."""
    enc = _keys.get(k)
    if enc is None:
        key = k.strip()
        if not key:
            enc = ""
        elif not _HEADER_KEY.fullmatch(key):
            raise errors.BadHeaderError(key)
        else:
            enc = key + ": "
        if len(_keys) < MAX_CACHED_KEYS:
            _keys[k] = enc
    return enc


def header_block(headers: dict[str, str]) -> bytes:
    """The NATS/1.0 header block nats-py would build for ``headers``. Built as one string and
    encoded once (~1.9 us for a request's ten headers, 2.8 as a bytes join of each line): a
    value with CR or LF inside (after nats-py's strip) shows as a line too many, and the block
    is built again with them made spaces."""
    if not headers:
        return _EMPTY_BLOCK  # a reply whose routing metadata travels in its body
    keys = _keys
    parts = ["NATS/1.0\r\n"]
    for k, v in headers.items():
        key = keys.get(k)
        if key is None:
            key = _key(k)
        if key:
            parts += (key, v.strip(), "\r\n")
    parts.append("\r\n")
    block = "".join(parts)
    lines = len(parts) // 3 + 2  # NATS/1.0, one per header, the blank line
    if block.count("\n") != lines or block.count("\r") != lines:
        return _header_block_escaped(headers)
    return block.encode()


def _header_block_escaped(headers: dict[str, str]) -> bytes:
    """:func:`header_block` for headers whose values hold CR or LF: made spaces, as nats-py does."""
    parts = [_HDR_LINE]
    for k, v in headers.items():
        key = _key(k)
        if not key:
            continue
        value = v.strip()
        if "\r" in value or "\n" in value:
            value = value.translate(_VALUE_NEWLINES)
        parts.append((key + value).encode() + _CRLF)
    parts.append(_CRLF)
    return b"".join(parts)


def encode(subject: str, reply: str, payload: bytes, headers: dict[str, str] | None) -> bytes:
    """The PUB or HPUB command nats-py sends for this message (byte for byte)."""
    if not subject or _SUBJECT_INVALID.search(subject) or (reply and _SUBJECT_INVALID.search(reply)):
        raise errors.BadSubjectError
    if headers is None:
        return b"".join(((f"PUB {subject} {reply} {len(payload)}\r\n").encode(), payload, _CRLF))
    hdr = header_block(headers)
    n = len(hdr)
    return b"".join(((f"HPUB {subject} {reply} {n} {n + len(payload)}\r\n").encode(), hdr, payload, _CRLF))


_publishers: weakref.WeakKeyDictionary[NATS, Publisher] = weakref.WeakKeyDictionary()


class Publisher:
    """Publishes on one client; get it with :meth:`of` (one per client: one flush per iteration)."""

    __slots__ = ("__weakref__", "_loop", "_scheduled", "fast", "nc")

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        #: False: this nats-py lacks what the fast path needs; every publish is nc.publish.
        self.fast = natsinternals.support().fast_publish
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def of(cls, nc: NATS) -> Publisher:
        pub = _publishers.get(nc)
        if pub is None:
            pub = _publishers[nc] = cls(nc)
        return pub

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """As ``nc.publish``, same errors; the bytes leave at the end of this loop iteration."""
        nc = self.nc
        if not self.fast or not nc.is_connected:  # nats-py's buffer, bound and errors
            await nc.publish(subject, payload, reply=reply, headers=headers)
            return
        if len(payload) > nc.max_payload:
            raise errors.MaxPayloadError
        cmd = encode(subject, reply, payload, headers)
        stats = nc.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += len(payload)
        if natsinternals.append_pending(nc, cmd):
            await natsinternals.flush_forced(nc)  # back-pressure, as nats-py applies it
        elif not self._scheduled:
            self._scheduled = True
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        natsinternals.write_pending(self.nc, self._loop)


async def publish(nc: NATS, subject: str, payload: bytes = b"", reply: str = "",
                  headers: dict[str, str] | None = None) -> None:
    """``Publisher.of(nc).publish(...)``: for callers that do not keep the publisher."""
    await Publisher.of(nc).publish(subject, payload, reply, headers)


async def flush(nc: NATS, timeout: float = 5.0) -> None:
    """Wait until the broker has seen everything sent on ``nc`` so far (a PING/PONG round trip):
    use it, never ``nc.flush()``, before telling another party "subscribed" or "started".
    nats-py 2.16's own flush can overtake its buffered commands (see
    :func:`zmlcore.bus.natsinternals.flush_in_order`)."""
    await natsinternals.flush_in_order(nc, timeout)

