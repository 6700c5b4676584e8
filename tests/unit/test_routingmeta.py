"""Routing metadata has one schema, zmlcore.messages.RoutingInfo, and every way it travels is
derived from it: the reply body's ``zml`` object, ``Zml-*`` NATS headers, ``x-zml-*`` HTTP
headers, ``zml-*`` gRPC metadata, zml.v1's Routing message and the SDK's ``zml.Routing``. These
tests go field by field over RoutingInfo, so a field added there is checked on every way with no
change here, and any copy that drifts fails."""

from __future__ import annotations

import dataclasses
import doctest
import types
import typing
from typing import Any

import msgspec
import pytest

import zml
from zml._core import (
    RawReply,
    build_infer,
    decode_nats_stream,
    decode_reply,
    lower_headers,
    routing_from_dict,
    routing_from_headers,
)
from zmlcore import subjects
from zmlcore.messages import ROUTING_HEADER_WORDS, RoutingInfo, StreamStart
from zmlcore.reply import routingmeta
from zmlcore.rpc import codec
from zmlcore.rpc import status as rpc_status
from zmlcore.rpc import zml_pb2 as pb

FIELDS = msgspec.structs.fields(RoutingInfo)


def _sample(name: str, tp: Any, i: int) -> Any:
    """A value of type ``tp`` that is not the field's default."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) and type(None) in args:
        return _sample(name, next(a for a in args if a is not type(None)), i)
    if tp is str:
        return f"{name}-{i}"
    if tp is int:
        return 100 + i
    if tp is float:
        return 0.125 * (i + 1)
    if tp is bool:
        return True
    raise AssertionError(f"RoutingInfo.{name}: add a sample for {tp!r} here")


#: Every field set, none at its default.
FULL = RoutingInfo(**{f.name: _sample(f.name, f.type, i) for i, f in enumerate(FIELDS)})


def test_doctests() -> None:
    assert doctest.testmod(routingmeta).failed == 0


def test_the_sample_sets_every_field() -> None:
    default = RoutingInfo()
    assert all(getattr(FULL, f.name) != getattr(default, f.name) for f in FIELDS)


def test_every_schema_has_every_field() -> None:
    names = [f.name for f in FIELDS]
    assert [name for name, _, _ in routingmeta.FIELDS] == names == list(ROUTING_HEADER_WORDS)
    assert set(pb.Routing.DESCRIPTOR.fields_by_name) == set(names)
    assert set(rpc_status.ROUTING_METADATA) == {http for _, _, http in routingmeta.FIELDS}
    # Optional fields (None: not known) are optional in the proto too, so "unset" is not 0.
    for f in FIELDS:
        optional = type(None) in typing.get_args(f.type)
        assert pb.Routing.DESCRIPTOR.fields_by_name[f.name].has_presence == optional, f.name


def test_the_sdk_routing_mirrors_the_schema() -> None:
    """zml.Routing is a plain dataclass (0.3's type: dataclasses.asdict gives dicts all the way
    down), kept field for field, type for type and default for default with RoutingInfo."""
    sdk = {f.name: f for f in dataclasses.fields(zml.Routing)}
    assert set(sdk) == {f.name for f in FIELDS}
    hints = typing.get_type_hints(zml.Routing)
    for f in FIELDS:
        assert hints[f.name] == f.type, f.name
        assert sdk[f.name].default == f.default, f.name
    r = routingmeta.typed(msgspec.structs.asdict(FULL), zml.Routing)
    assert dataclasses.asdict(r) == msgspec.structs.asdict(FULL)


def test_the_published_header_names_do_not_change() -> None:
    by_field = {name: (nats, http) for name, nats, http in routingmeta.FIELDS}
    assert by_field["node_id"] == (subjects.H_NODE_ID, "x-zml-node-id")
    assert by_field["accelerator_type"] == (subjects.H_ACCELERATOR_TYPE, "x-zml-accelerator-type")
    assert by_field["family"] == (subjects.H_FAMILY, "x-zml-family")
    assert by_field["policy"] == (subjects.H_POLICY, "x-zml-policy")
    assert by_field["queue_depth_at_dispatch"] == (subjects.H_QUEUE_DEPTH, "x-zml-queue-depth")
    assert by_field["decision_id"] == (subjects.H_DECISION_ID, "x-zml-decision-id")
    assert by_field["request_id"] == (subjects.H_REQUEST_ID, "x-zml-request-id")
    assert by_field["router_id"] == ("Zml-Router-Id", "x-zml-router-id")
    assert by_field["label"] == (subjects.H_LABEL, "x-zml-label")
    assert rpc_status.ROUTING_METADATA["x-zml-node-id"] == "zml-node-id"


def test_every_field_travels_router_to_gateway_to_grpc_to_sdk() -> None:
    nats = routingmeta.nats_headers(FULL)
    assert len(nats) == len(FIELDS)
    http = routingmeta.http_headers(nats)
    assert http == routingmeta.http_headers_of(FULL)  # relayed, or written from the body's zml object
    http_str = {k.decode(): v.decode() for k, v in http}
    grpc_md = {rpc_status.ROUTING_METADATA[k]: v for k, v in http_str.items()}  # as grpc_front passes them
    for headers in (lower_headers(nats), http_str, grpc_md):  # a NATS reply, an HTTP one, a gRPC call
        assert routingmeta.read(headers) == FULL
        got = routing_from_headers(headers)
        assert isinstance(got, zml.Routing) and dataclasses.asdict(got) == msgspec.structs.asdict(FULL)


def test_every_field_travels_in_the_body_to_grpc_and_the_sdk() -> None:
    body = b'{"id":"x","choices":[{"message":{"content":"hi"}}],"zml":' + msgspec.json.encode(FULL) + b"}"
    assert routingmeta.from_body(body) == FULL
    message = codec.reply_from_json(body).routing
    for f in FIELDS:
        assert getattr(message, f.name) == getattr(FULL, f.name), f.name
    call = build_infer(model="m", prompt="hi")
    sdk = decode_reply(RawReply(status=200, headers={}, body=body), call).routing
    assert dataclasses.asdict(sdk) == msgspec.structs.asdict(FULL)
    start = decode_nats_stream({"zml-stream": "start"}, msgspec.json.encode(StreamStart(routing=FULL))).routing
    assert start is not None and dataclasses.asdict(start) == msgspec.structs.asdict(FULL)


def test_a_field_not_known_yet_is_no_header_and_unset_in_grpc() -> None:
    info = RoutingInfo(node_id="n1", time_to_first_token=None, total_tokens=None)
    nats = routingmeta.nats_headers(info)
    assert "Zml-Time-To-First-Token" not in nats and "Zml-Total-Tokens" not in nats
    assert routingmeta.read(lower_headers(nats)) == info
    message = codec.routing_message(info)
    assert not message.HasField("time_to_first_token") and not message.HasField("total_tokens")


@pytest.mark.parametrize("label", ["équipe β", " edge ", "50% off", "a\r\nInjected: 1", "\t", "", "plain-ascii_1.2"])
def test_any_text_travels_as_printable_ascii_and_comes_back(label: str) -> None:
    info = RoutingInfo(node_id="n1", label=label, router_id=label)
    for name, value in routingmeta.nats_headers(info).items():
        assert value.isascii() and value.isprintable() and value == value.strip(), (name, value)
    assert routingmeta.read(lower_headers(routingmeta.nats_headers(info))) == info
    assert routingmeta.nats_headers(RoutingInfo(node_id="n-1.x"))["Zml-Node-Id"] == "n-1.x"  # plain: as is


def test_an_empty_text_is_no_header() -> None:
    """A reply of a request without a cost label carries no ``x-zml-label:`` with nothing after it."""
    info = RoutingInfo(node_id="n1", label="", policy="latency")
    nats = routingmeta.nats_headers(info)
    assert "Zml-Label" not in nats and nats["Zml-Policy"] == "latency"
    assert b"x-zml-label" not in dict(routingmeta.http_headers(nats))
    assert b"x-zml-label" not in dict(routingmeta.http_headers_of(info))
    assert routingmeta.read(lower_headers(nats)) == info


def test_a_value_of_the_wrong_type_loses_only_its_field() -> None:
    got = routingmeta.read({"x-zml-node-id": "n1", "x-zml-queue-depth": "many", "x-zml-attempts": "2"})
    assert got == RoutingInfo(node_id="n1", attempts=2)
    assert routing_from_dict({"node_id": "n1", "total_tokens": "x", "label": "l"}) == zml.Routing(node_id="n1", label="l")


def test_a_reply_without_routing_headers_has_no_routing() -> None:
    assert routingmeta.read({"content-type": "application/json"}) is None
    assert routingmeta.http_headers({subjects.H_ERROR_CODE: "TIMEOUT"}) == []
    assert routing_from_headers({"x-zml-request-id": "r"}) is None


def test_the_backend_header_is_compact() -> None:
    info = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="latency",
                       queue_depth_at_dispatch=3, decision_id="d1", request_id="r1", attempts=2)
    assert routingmeta.backend_header(info) == "node=n1;family=H100;policy=latency;queue=3;decision=d1"


def test_the_routing_metadata_is_read_back_from_a_reply_body_and_a_start_message() -> None:
    info = RoutingInfo(node_id="n1", accelerator_type="nvidia_h100", family="H100", policy="latency",
                       queue_depth_at_dispatch=2, decision_id="d", request_id="r", total_tokens=21)
    body = b'{"id":"x","choices":[{"message":{"content":"\\"zml\\": {}"}}],"zml":' + msgspec.json.encode(info) + b"}\n"
    got = routingmeta.from_body(body)
    assert got == info
    assert routingmeta.http_headers_of(got) == routingmeta.http_headers(routingmeta.nats_headers(info))
    assert routingmeta.from_start(msgspec.json.encode(StreamStart(routing=info))) == info
    for junk in (b"", b"{}", b'{"zml":', b'{"zml": 3}', b'{"zml":{"node_id": 1}}', b'{"zml":{}}'):
        assert routingmeta.from_body(junk) is None
    assert routingmeta.from_start(b"not json") is None
    assert routingmeta.from_start(b'{"routing": {}}') is None
