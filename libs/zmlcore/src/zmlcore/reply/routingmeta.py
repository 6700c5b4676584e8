"""Routing metadata as headers, both ways: the one map between :class:`RoutingInfo` fields,
``Zml-*`` NATS headers (router replies) and ``x-zml-*`` HTTP headers (gateway replies).

The router writes :func:`nats_headers`; the gateway turns them into HTTP headers with
:func:`http_headers`; the SDK reads either with :func:`read` (its transports lower-case header
names first).

>>> h = nats_headers(RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100",
...                              policy="latency", queue_depth_at_dispatch=2, decision_id="d", request_id="r"))
>>> h["Zml-Node-Id"], http_headers(h)[4]
('n1', (b'x-zml-queue-depth', b'2'))
>>> read({k.lower(): v for k, v in h.items()})["queue_depth_at_dispatch"]
'2'
"""

from __future__ import annotations

from collections.abc import Mapping

from zmlcore import subjects
import msgspec

from zmlcore.messages import RoutingInfo, StreamStart, routing_info_decoder

#: (RoutingInfo field, NATS header, HTTP header), in the order the HTTP headers are sent.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("node_id", subjects.H_NODE_ID, "x-zml-node-id"),
    ("accelerator_type", subjects.H_ACCELERATOR_TYPE, "x-zml-accelerator-type"),
    ("family", subjects.H_FAMILY, "x-zml-family"),
    ("policy", subjects.H_POLICY, "x-zml-policy"),
    ("queue_depth_at_dispatch", subjects.H_QUEUE_DEPTH, "x-zml-queue-depth"),
    ("decision_id", subjects.H_DECISION_ID, "x-zml-decision-id"),
    ("request_id", subjects.H_REQUEST_ID, "x-zml-request-id"),
)
_NATS_TO_HTTP = tuple((nats, http.encode()) for _, nats, http in FIELDS)
#: lower-cased HTTP and NATS names of each field, for readers of either kind of reply.
_READ = tuple((field, http, nats.lower()) for field, nats, http in FIELDS)


def nats_headers(info: RoutingInfo) -> dict[str, str]:
    """The ``Zml-*`` headers of a router reply (or a stream's start message)."""
    return {
        subjects.H_NODE_ID: info.node_id,
        subjects.H_ACCELERATOR_TYPE: info.accelerator_type,
        subjects.H_FAMILY: info.family,
        subjects.H_POLICY: info.policy,
        subjects.H_QUEUE_DEPTH: str(info.queue_depth_at_dispatch),
        subjects.H_DECISION_ID: info.decision_id,
        subjects.H_REQUEST_ID: info.request_id,
    }


def http_headers(nats: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The ``x-zml-*`` HTTP headers (ASGI pairs) for the ``Zml-*`` ones present in ``nats``."""
    out = []
    for name, http in _NATS_TO_HTTP:
        value = nats.get(name)
        if value is not None:
            out.append((http, value.encode()))
    return out


def read(headers: Mapping[str, str]) -> dict[str, str] | None:
    """RoutingInfo field -> value from lower-cased ``x-zml-*`` or ``zml-*`` headers; None when
    they carry no routing metadata (no node id)."""
    out: dict[str, str] = {}
    for field, http, nats in _READ:
        value = headers.get(http) or headers.get(nats)
        if value is not None:
            out[field] = value
    return out if "node_id" in out else None


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
        return routing_info_decoder.decode(tail[:-1])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def from_start(data: bytes) -> RoutingInfo | None:
    """The routing metadata of a stream's ``start`` message body, or None."""
    try:
        return _start_decoder.decode(data).routing
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def http_headers_of(info: RoutingInfo) -> list[tuple[bytes, bytes]]:
    """The ``x-zml-*`` HTTP headers (ASGI pairs) of ``info``, as :func:`http_headers` gives them
    from a router's ``Zml-*`` headers."""
    return http_headers(nats_headers(info))
