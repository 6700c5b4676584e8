"""Routing metadata as headers (zmlcore.reply.routingmeta): what the router writes, the gateway
relays as HTTP headers and the SDK reads back from either is the same RoutingInfo."""

from __future__ import annotations

import doctest

from zmlcore import subjects
from zmlcore.reply import routingmeta
from zmlcore.messages import RoutingInfo
from zml._core import lower_headers, routing_from_headers

INFO = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="latency",
                   queue_depth_at_dispatch=3, decision_id="d1", request_id="r1", attempts=2)


def test_doctests() -> None:
    assert doctest.testmod(routingmeta).failed == 0


def test_every_routing_field_travels_router_to_gateway_to_sdk() -> None:
    nats = routingmeta.nats_headers(INFO)
    assert nats[subjects.H_NODE_ID] == "n1" and nats[subjects.H_QUEUE_DEPTH] == "3"
    http = {k.decode(): v.decode() for k, v in routingmeta.http_headers(nats)}
    assert http == {"x-zml-node-id": "n1", "x-zml-accelerator-type": "nvidia_h100", "x-zml-family": "H100",
                    "x-zml-policy": "latency", "x-zml-queue-depth": "3", "x-zml-decision-id": "d1",
                    "x-zml-request-id": "r1"}
    for headers in (http, lower_headers(nats)):  # an HTTP reply, and a NATS one
        r = routing_from_headers(headers)
        assert r is not None
        assert (r.node_id, r.accelerator_type, r.family, r.policy, r.queue_depth_at_dispatch, r.decision_id,
                r.request_id) == ("n1", "nvidia_h100", "H100", "latency", 3, "d1", "r1")


def test_a_reply_without_routing_headers_has_no_routing() -> None:
    assert routingmeta.read({"content-type": "application/json"}) is None
    assert routingmeta.http_headers({subjects.H_ERROR_CODE: "TIMEOUT"}) == []
    assert routing_from_headers({"x-zml-request-id": "r"}) is None


def test_the_backend_header_is_compact() -> None:
    assert routingmeta.backend_header(INFO) == "node=n1;family=H100;policy=latency;queue=3;decision=d1"


def test_the_routing_metadata_is_read_back_from_a_reply_body_and_a_start_message() -> None:
    import msgspec

    from zmlcore.reply import routingmeta
    from zmlcore.messages import RoutingInfo, StreamStart

    info = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="latency",
                       queue_depth_at_dispatch=2, decision_id="d", request_id="r", total_tokens=21)
    body = b'{"id":"x","choices":[{"message":{"content":"\\"zml\\": {}"}}],"zml":' + msgspec.json.encode(info) + b"}\n"
    got = routingmeta.from_body(body)
    assert got == info
    assert routingmeta.http_headers_of(got) == routingmeta.http_headers(routingmeta.nats_headers(info))
    assert routingmeta.from_start(msgspec.json.encode(StreamStart(routing=info))) == info
    for junk in (b"", b"{}", b'{"zml":', b'{"zml": 3}', b'{"zml":{"node_id": 1}}'):
        assert routingmeta.from_body(junk) is None
    assert routingmeta.from_start(b"not json") is None
