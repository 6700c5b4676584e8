"""The one module that touches nats-py's private attributes, and the start-up check that they
are there.

nats-py documents its client, subscriptions and KV watchers, not their insides. Five things
ZML does need the insides, each for a reason measured or seen (the modules that use them say
which):

========================  ==========================================  ===========================
what                      nats-py privates                            without them
========================  ==========================================  ===========================
fast publish, ordered     ``Client._pending``, ``_pending_data_size``,  every publish goes through
flush                     ``_max_pending_size``, ``_flush_pending``,    ``nc.publish`` (a flush
(zmlcore.bus.publish)     ``_transport`` (its ``_io_writer``),          round per publish): slower,
                          ``_flush_queue``                              correct; logged once; a
                                                                        flush may overtake a SUB
direct delivery           ``Subscription._pending_queue``,              a callback subscription (a
(zmlcore.bus.direct:      ``_pending_size``                             task switch per message;
replies, peers' counts)                                                 two subjects' messages may
                                                                        be reordered); logged once
KV watch consumers        ``KeyWatcher._sub``, the JetStream            none: :func:`check` fails
(zmlcore.bus.kvfollow,    subscription's ``_stream`` / ``_consumer``,   at start-up
zmlcore.bus.ensure,       ``JetStreamManager._nc``
zmlcore.batch.store)
header blocks parsed      ``Client._parse_header_lines()``              nats-py's own parser (a
in one pass (this                                                       generator per character
module, connect)                                                        of each name: ~2.5x)
TLS or nothing            ``Client._process_info()``                    none: :func:`check` fails
(zmlcore.bus.connect)                                                   at start-up
an abandoned flush does   ``Client._pongs``, ``_pongs_received``,       a flush that timed out (or
not kill the reader       ``_pings_outstanding``,                       was cancelled) stops the
(zmlcore.bus.connect)     ``_process_pong()``                           connection's reader at the
                                                                        next PONG; logged once
========================  ==========================================  ===========================

:func:`check` looks once, at start-up (``service_main`` before it connects, a
:class:`~zmlcore.bus.kvfollow.KVFollower` being built; ``zmlcore.bus.connect.connect``, which
the SDK uses too, takes the fast-path decisions), at nats-py's classes: an attribute a class's ``__init__``
no longer stores, or a method it no longer has, is reported before anything runs, naming the
nats-py version and the missing piece, instead of an AttributeError in a loop (or a fast path
silently off) later. It also fails without ``nats.errors.BadHeaderError`` (public, nats-py 2.16
on), which the publish encoder raises as nats-py 2.16's own does (older releases neither
validate subjects nor strip CR/LF from header values). The versions checked against are
:data:`VERIFIED`, the range pyproject.toml allows; CI also runs the suites against the newest
release (.ci/run).

Nothing outside this module reads or writes a private attribute of a nats-py object.

    support = check()          # ConfigError at start-up if a required piece is missing
    if support.fast_publish: ...
"""

from __future__ import annotations

import asyncio
import dis
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.aio.transport import TcpTransport
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue
from nats.js.manager import JetStreamManager

from zmlcore.errors import ConfigError

log = logging.getLogger("zml.natsinternals")

#: The nats-py releases this module was checked against (oldest, newest), and the range
#: pyproject.toml allows from them (a test keeps the two equal): patch releases of the newest
#: are let in; CI runs the suites against any newer release (.ci/run) before the ceiling moves.
VERIFIED = ("2.16.0", "2.16.0")
REQUIREMENT = "nats-py>=2.16,<2.17"


class Piece(NamedTuple):
    """One thing ZML uses: an attribute ``owner.__init__`` stores (``attr``), a method of
    ``owner`` (``method``) or a name a module defines (``name``)."""

    owner: Any
    name: str
    kind: str = "attr"

    def __str__(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or self.owner.__name__
        return f"{owner}.{self.name}{'()' if self.kind == 'method' else ''}"


def _pieces(owner: type, names: Iterable[str], methods: Iterable[str] = ()) -> tuple[Piece, ...]:
    return (*(Piece(owner, n) for n in names), *(Piece(owner, m, "method") for m in methods))


#: Fast publish (zmlcore.bus.publish).
PUBLISH = (*_pieces(NATS, ("_pending", "_pending_data_size", "_max_pending_size", "_transport", "_flush_queue"),
                    ("_flush_pending",)),
           *_pieces(TcpTransport, ("_io_writer",)))
#: Direct delivery (zmlcore.bus.direct: the reply mux, the router's in-flight sharing).
DELIVER = _pieces(Subscription, ("_pending_queue", "_pending_size"))
#: A PONG for an abandoned flush (:func:`forgive_abandoned_pongs`).
PONGS = _pieces(NATS, ("_pongs", "_pongs_received", "_pings_outstanding"), ("_process_pong",))
#: Header blocks parsed by :func:`parse_header_lines` (:func:`fast_headers`).
HEADERS = (Piece(NATS, "_parse_header_lines", "method"),)
#: Required: which consumer a KV watch reads, the client behind a JetStream context (kvfollow,
#: connect), and nats-py 2.16's header error (publish).
REQUIRED = (*_pieces(KeyValue.KeyWatcher, ("_sub",)),
            *_pieces(JetStreamContext.PushSubscription, ("_stream", "_consumer")),
            *_pieces(JetStreamManager, ("_nc",)),
            Piece(NATS, "_process_info", "method"),
            Piece(nats.errors, "BadHeaderError", "name"))


def version() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "(unknown version)"


def _stored(owner: type) -> frozenset[str]:
    """Attribute names ``owner.__init__`` assigns (``self.x = ...``), read from its bytecode:
    no instance is built, so nothing runs."""
    init = getattr(owner, "__init__", None)
    code = getattr(init, "__code__", None)
    if code is None:
        return frozenset()
    return frozenset(str(i.argval) for i in dis.get_instructions(code) if i.opname == "STORE_ATTR")


def missing(pieces: Iterable[Piece]) -> list[Piece]:
    """The pieces this nats-py lacks: a method not on its class, an attribute its ``__init__``
    (or, for a subclass, a base's) no longer stores."""
    out = []
    for p in pieces:
        if p.kind == "attr":
            ok = any(p.name in _stored(k) for k in p.owner.__mro__)
        else:
            ok = callable(getattr(p.owner, p.name, None))
        if not ok:
            out.append(p)
    return out


class Support(NamedTuple):
    """What this nats-py lets ZML do (see the module doc)."""

    version: str
    fast_publish: bool
    direct_delivery: bool
    #: Required pieces that are missing (then :func:`check` raises).
    required_missing: tuple[Piece, ...]
    pong_guard: bool = True


def probe(publish: Iterable[Piece] = PUBLISH, deliver: Iterable[Piece] = DELIVER,
          required: Iterable[Piece] = REQUIRED, nats_version: str | None = None,
          pongs: Iterable[Piece] = PONGS) -> Support:
    """The decision for these pieces (the defaults: nats-py's real classes)."""
    v = nats_version or version()
    no_pub, no_deliver, no_pongs = missing(publish), missing(deliver), missing(pongs)
    if no_pongs:
        log.warning("nats-py %s lacks %s: a flush that times out may stop a connection's reader until "
                    "its pings go stale (ZML is verified with nats-py %s to %s)", v, ", ".join(map(str, no_pongs)),
                    *VERIFIED)
    if no_pub:
        log.warning("nats-py %s lacks %s: publishing through nc.publish (slower; ZML is verified with "
                    "nats-py %s to %s)", v, ", ".join(map(str, no_pub)), *VERIFIED)
    if no_deliver:
        log.warning("nats-py %s lacks %s: replies and peers' counts delivered through callback subscriptions "
                    "(slower, and a peer's counts may be applied out of order; ZML is verified with nats-py %s "
                    "to %s)", v, ", ".join(map(str, no_deliver)), *VERIFIED)
    return Support(v, not no_pub, not no_deliver, tuple(missing(required)), not no_pongs)


@functools.cache
def support() -> Support:
    """:func:`probe` of the installed nats-py, once per process."""
    return probe()


def check(found: Support | None = None) -> Support:
    """The installed nats-py's :class:`Support`; raises ConfigError, naming the nats-py version
    and what it lacks, when a piece ZML cannot do without is missing. Call it at start-up."""
    s = found if found is not None else support()
    if s.required_missing:
        raise ConfigError(
            f"nats-py {s.version} lacks {', '.join(map(str, s.required_missing))}, which ZML relies on "
            f"(zmlcore.bus.natsinternals); ZML is verified with nats-py {VERIFIED[0]} to {VERIFIED[1]}: "
            f"pip install '{REQUIREMENT}'")
    return s


# --- fast publish (zmlcore.bus.publish) -------------------------------------------------------


def append_pending(nc: NATS, cmd: bytes) -> bool:
    """Put a protocol command on nats-py's outgoing buffer, where its own publishes go; True
    when the buffer is past ``pending_size`` (the caller then awaits :func:`flush_forced`)."""
    c: Any = nc
    c._pending.append(cmd)
    c._pending_data_size += len(cmd)
    return bool(0 < c._max_pending_size < c._pending_data_size)


async def flush_forced(nc: NATS) -> None:
    """nats-py's back-pressure: write the buffer and wait for the socket to drain."""
    await nc._flush_pending(force_flush=True)


def write_pending(nc: NATS, loop: asyncio.AbstractEventLoop | None) -> None:
    """Write everything in nats-py's buffer in one ``writelines``, now; or, when the socket is
    backed up (or not a plain stream), wake nats-py's flusher, which writes and awaits drain()."""
    c: Any = nc
    if not c._pending or not nc.is_connected:
        return  # sent by nats-py after its reconnect, or already by its flusher
    transport = c._transport
    writer = getattr(transport, "_io_writer", None)  # a TCP transport's (TLS too); websocket: the flusher
    sock = getattr(writer, "transport", None)
    if sock is None or sock.get_write_buffer_size() > sock.get_write_buffer_limits()[1]:
        queue = c._flush_queue
        if queue is not None and queue.empty():
            queue.put_nowait(loop.create_future() if loop else asyncio.Future())
        return
    transport.writelines(c._pending)
    c._pending = []
    c._pending_data_size = 0


async def flush_in_order(nc: NATS, timeout: float) -> None:
    """``nc.flush(timeout)`` whose PONG means the broker has seen everything this client sent
    before it. nats-py 2.16's ``flush`` writes its PING straight to the socket, ahead of the
    commands still in its buffer (a SUB just made, a publish): the PONG can come back before
    the broker has the subscription, and a message another connection publishes on that
    signal is dropped (seen: a requester's inbox missing the router's first message). The
    buffer is written first; a backed-up socket is drained first (within ``timeout``)."""
    c: Any = nc
    if support().fast_publish and c._pending and nc.is_connected:
        write_pending(nc, None)
        if c._pending:  # socket backed up: nats-py's flusher writes it and awaits drain()
            await asyncio.wait_for(flush_forced(nc), timeout)
    await nc.flush(timeout)  # type: ignore[arg-type]  # typed int, works with any seconds


# --- direct delivery (zmlcore.bus.direct) -----------------------------------------------------


class _Deliver(asyncio.Queue):  # type: ignore[type-arg]
    """Stands in for a subscription's pending queue, into which nats-py's reader puts each
    message: handed on at once instead. A callback subscription would queue it for a task of
    its own to take out and await the callback: a task switch per message (per stream chunk),
    for a push into a deque. Never raises into nats-py's reader."""

    def __init__(self, sub: Any, deliver: Callable[[Msg], None]) -> None:
        super().__init__()
        self._sub = sub
        self._deliver = deliver

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size -= len(msg.data)  # nats-py counts it as pending until taken
        try:
            self._deliver(msg)
        except Exception:  # a bug of ours must not take the connection's reader down
            log.exception("message delivery failed")


def deliver_directly(sub: Subscription, deliver: Callable[[Msg], None]) -> bool:
    """Make nats-py's reader call ``deliver(msg)`` for each of ``sub``'s messages, in the
    reader (no task); False when this nats-py cannot (the caller subscribes with a callback)."""
    s: Any = sub
    if not support().direct_delivery or not isinstance(getattr(s, "_pending_queue", None), asyncio.Queue):
        return False
    s._pending_queue = _Deliver(s, deliver)
    return True


# --- KV watches (zmlcore.bus.kvfollow) and JetStream contexts (zmlcore.bus.ensure) ------------


def watch_consumer(watcher: KeyValue.KeyWatcher) -> tuple[str, str] | None:
    """(stream, consumer) a KV watch reads now (nats-py renames an ordered consumer when it
    re-creates it), or None before it has one."""
    return sub_consumer(getattr(watcher, "_sub", None))


def sub_consumer(sub: Any) -> tuple[str, str] | None:
    """(stream, consumer) a JetStream push subscription (ordered: as re-created) reads now, or
    None (the batch store deletes a one-off read's consumer as the read ends)."""
    if sub is None or not getattr(sub, "_consumer", None):
        return None
    return sub._stream, sub._consumer


def client_of(js: JetStreamContext) -> NATS:
    """The client a JetStream context was made from."""
    return js._nc


# --- a PONG for an abandoned flush (zmlcore.bus.connect) ---------------------------------------


def forgive_abandoned_pongs(nc: NATS) -> None:
    """Let the PONG of a flush whose waiter gave up pass instead of stopping the reader.

    Why: nats-py 2.16 keeps one future per PING in ``_pongs`` and, on each PONG, sets the
    first one's result. A flush that timed out, or whose task was cancelled (a service stopped
    while confirming its subscriptions), leaves its future there cancelled: the PONG's
    ``set_result`` raises InvalidStateError, which nats-py's read loop logs and then stops on,
    with no reconnect (nats-io/nats.py#914). The connection still says "connected" but reads
    nothing (no replies, no KV updates) until its pings go stale, minutes later. Seen in CI on
    a router and a gateway stopped while starting."""
    if not support().pong_guard:
        return
    c: Any = nc
    original = c._process_pong

    async def process_pong() -> None:
        pongs = c._pongs
        if pongs and pongs[0].done():  # its flush was abandoned: this PONG is still its answer
            pongs.pop(0)
            c._pongs_received += 1
            c._pings_outstanding = 0
            return
        await original()

    c._process_pong = process_pong


# --- header blocks (zmlcore.bus.connect) ------------------------------------------------------

#: What ``bytes.strip()`` strips: ``str.strip()`` also strips \x1c-\x1f, which nats-py keeps.
_WS = " \t\n\r\x0b\x0c"


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py 2.16's ``Client._parse_header_lines``, the same dict for every input, in a
    third of the time: an ASCII block (every ZML header) is decoded once and split as text,
    and a name's inner whitespace is found by ``str.split`` instead of a generator per
    character. Every message with headers pays it (a request reaching the router: ~10 headers,
    ~25 us -> ~10 us); anything else takes nats-py's byte-wise path, kept as it is."""
    if not raw.isascii():
        return _parse_bytes(raw)
    out = {}
    for line in raw.decode("ascii").split("\r\n"):
        if line:
            name, sep, value = line.partition(":")
            if sep:
                key = name.strip(_WS)
                if key and key.split() != [key]:  # whitespace in a name (str.isspace): not a header
                    continue
                out[key] = value.strip(_WS)
    return out


def _parse_bytes(raw: bytes) -> dict[str, str]:
    out = {}
    for line in raw.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        if key and key.split() != [key]:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def fast_headers(nc: NATS) -> None:
    """Parse ``nc``'s incoming header blocks with :func:`parse_header_lines` (nats-py calls
    ``self._parse_header_lines`` per message with headers, unless fast_mail_parser is installed)."""
    if missing(HEADERS):
        return
    c: Any = nc
    c._parse_header_lines = parse_header_lines


# --- TLS or nothing (zmlcore.bus.connect) -----------------------------------------------------


def before_connect(nc: NATS, check: Callable[[dict[str, Any]], None]) -> None:
    """Call ``check(server_info)`` with each server's INFO before nats-py answers it, on the
    first connection and on every reconnect; an exception ``check`` raises stops that attempt
    before CONNECT is sent (nats-py reports it to ``error_cb`` and tries the next server).

    Why: nats-py upgrades to TLS only when the server's INFO says ``tls_required``; a client
    given a CA or a tls:// URL that meets a server without TLS carries on in plaintext, its
    identity's signature and every message in the clear, without a word. The INFO it answers
    is where that is decided, so that is where it is refused."""
    c: Any = nc
    original = c._process_info

    async def process_info(info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection:  # INFO opening a connection (first or reconnect), before CONNECT
            check(info)
        await original(info, initial_connection=initial_connection)

    c._process_info = process_info
