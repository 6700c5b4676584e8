"""Routing metadata as headers, both ways, derived from :class:`RoutingInfo`: every field is a
``Zml-*`` NATS header (router replies) and an ``x-zml-*`` HTTP header (gateway replies), named
by :data:`zmlcore.messages.ROUTING_HEADER_WORDS`. A field added to RoutingInfo is a header here
with no change to this module.

The router writes :func:`nats_headers`; the gateway turns them into HTTP headers with
:func:`http_headers` (or writes them from a reply body's ``zml`` object with
:func:`http_headers_of`); the SDK reads either kind back, typed, with :func:`read` (its
transports lower-case header names first).

Values: numbers in decimal, strings as they are when printable ASCII without ``%`` or edge
spaces, else UTF-8 percent-encoded (a label may be any text; gRPC metadata and HTTP/1.1 carry
ASCII only); a ``None`` field or an empty text (no label) is no header: a reader gets the
field's default back.

>>> h = nats_headers(RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100",
...                              policy="latency", queue_depth_at_dispatch=2, decision_id="d",
...                              request_id="r", router_id="router-1", label="équipe"))
>>> h["Zml-Node-Id"], h["Zml-Label"], http_headers(h)[4]
('n1', '%C3%A9quipe', (b'x-zml-queue-depth', b'2'))
>>> got = read({k.lower(): v for k, v in h.items()})
>>> got.queue_depth_at_dispatch, got.router_id, got.label
(2, 'router-1', 'équipe')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, overload
from urllib.parse import quote, unquote

import msgspec

from zmlcore.messages import ROUTING_HEADER_WORDS, RoutingInfo, StreamStart, routing_info_decoder

__all__ = ["FIELDS", "backend_header", "from_body", "from_start", "http_headers", "http_headers_of",
           "nats_headers", "read", "typed"]

#: RoutingInfo, or a type with the same fields (the SDK's ``zml.Routing`` dataclass).
R = TypeVar("R")

#: (RoutingInfo field, NATS header, HTTP header), in RoutingInfo's order (the order sent).
FIELDS: tuple[tuple[str, str, str], ...] = tuple(
    (name, f"Zml-{word}", f"x-zml-{word.lower()}") for name, word in ROUTING_HEADER_WORDS.items()
)
_NATS_TO_HTTP = tuple((nats, http.encode()) for _, nats, http in FIELDS)
#: lower-cased HTTP and NATS names of each field, for readers of either kind of reply.
_READ = tuple((name, http, nats.lower()) for name, nats, http in FIELDS)
_TEXT = frozenset(f.name for f in msgspec.structs.fields(RoutingInfo) if f.type is str)
#: (field, NATS header, HTTP header, is text) for the writers; other fields are numbers.
_WRITE = tuple((name, nats, http.encode(), name in _TEXT) for name, nats, http in FIELDS)
_POSITION = {f.name: i for i, f in enumerate(msgspec.structs.fields(RoutingInfo))}
#: (position in RoutingInfo's fields, HTTP header, is text): all of a reply's values read in one
#: C call (msgspec.structs.astuple) instead of a getattr per field.
_WRITE_HTTP = tuple((_POSITION[name], http, text) for name, _, http, text in _WRITE)
_astuple = msgspec.structs.astuple
#: Left as they are in an escaped value: printable ASCII but space and ``%`` (the escape itself).
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def _values(info: RoutingInfo) -> list[tuple[str, bytes, str]]:
    """(NATS name, HTTP name, header value) of each field of ``info`` that is not None or "".
    Inline and call-free: this runs for every reply the gateway and the routers send."""
    out = []
    for name, nats, http, text in _WRITE:
        v = getattr(info, name)
        if v is None or v == "":
            continue
        if not text:
            v = str(v)  # int or float, in the form msgspec reads back (strict=False)
        elif not (v.isascii() and v.isprintable() and "%" not in v and v.strip() == v):
            v = quote(v, safe=_SAFE)
        out.append((nats, http, v))
    return out


def nats_headers(info: RoutingInfo) -> dict[str, str]:
    """The ``Zml-*`` headers of a router reply (or a stream's start message)."""
    return {nats: v for nats, _, v in _values(info)}


def http_headers(nats: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The ``x-zml-*`` HTTP headers (ASGI pairs) for the ``Zml-*`` ones present in ``nats``."""
    out = []
    for name, http in _NATS_TO_HTTP:
        value = nats.get(name)
        if value is not None:
            out.append((http, value.encode()))
    return out


def http_headers_of(info: RoutingInfo) -> list[tuple[bytes, bytes]]:
    """The ``x-zml-*`` HTTP headers (ASGI pairs) of ``info``, as :func:`http_headers` gives them
    from a router's ``Zml-*`` headers."""
    out = []
    values = _astuple(info)
    for i, http, text in _WRITE_HTTP:  # _values, inline: the gateway runs it for every reply
        v = values[i]
        if v is None or v == "":
            continue
        if not text:
            out.append((http, str(v).encode()))
        elif v.isascii() and v.isprintable() and "%" not in v and v.strip() == v:
            out.append((http, v.encode()))
        else:
            out.append((http, quote(v, safe=_SAFE).encode()))
    return out


def typed(values: Mapping[str, Any], into: type[R]) -> R:
    """``into`` (RoutingInfo, or a dataclass with its fields) from field -> value, numbers given as text accepted;
    a value of the wrong type leaves its field at the default rather than losing the rest."""
    try:
        return msgspec.convert(values, into, strict=False)
    except msgspec.ValidationError:
        good = {}
        for k, v in values.items():
            try:
                msgspec.convert({k: v}, into, strict=False)
            except msgspec.ValidationError:
                continue
            good[k] = v
        return msgspec.convert(good, into, strict=False)


@overload
def read(headers: Mapping[str, str]) -> RoutingInfo | None: ...
@overload
def read(headers: Mapping[str, str], into: type[R]) -> R | None: ...


def read(headers: Mapping[str, str], into: type[Any] = RoutingInfo) -> Any:
    """The routing metadata in lower-cased ``x-zml-*`` or ``zml-*`` headers, as ``into``; None
    when they carry none (no node id)."""
    out: dict[str, str] = {}
    for name, http, nats in _READ:
        value = headers.get(http) or headers.get(nats)
        if value is not None:
            out[name] = unquote(value) if "%" in value else value
    return typed(out, into) if "node_id" in out else None


def backend_header(info: RoutingInfo) -> str:
    """The compact ``x-zml-routing`` value sent to a node with each request."""
    return (f"node={info.node_id};family={info.family};policy={info.policy};"
            f"queue={info.queue_depth_at_dispatch};decision={info.decision_id}")


_ZML = b'"zml":'
_start_decoder = msgspec.json.Decoder(StreamStart)


def from_body(data: bytes) -> RoutingInfo | None:
    """The ``zml`` object a router appended to a reply body (the last key: one small decode
    of the tail, not of the body), or None."""
    i = data.rfind(_ZML)
    if i < 0:
        return None
    tail = data[i + len(_ZML):].rstrip()
    if tail[-1:] != b"}":
        return None
    try:
        info = routing_info_decoder.decode(tail[:-1])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if info.node_id else None


def from_start(data: bytes) -> RoutingInfo | None:
    """The routing metadata of a stream's ``start`` message body, or None."""
    try:
        info = _start_decoder.decode(data).routing
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return info if info.node_id else None
