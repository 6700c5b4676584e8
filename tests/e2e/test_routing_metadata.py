"""Every field of the routing metadata (zmlcore.messages.RoutingInfo) reaches the caller on every
way in: HTTP headers, gRPC metadata and the zml.v1 Routing message, raw NATS headers, and the
SDK's ``zml.Routing`` over HTTP, gRPC and NATS, replies and streams alike. Checked field by field
over RoutingInfo, so a field added there is checked here too. The API key carries a label that
is not ASCII (it travels percent-encoded in headers). A broker of its own: a key in the bucket
turns authentication on for the gateway."""

from __future__ import annotations

import asyncio
import json
import time
import typing
from collections.abc import Iterator, Mapping

import grpc
import httpx
import msgspec
import nats
import pytest

import zml
from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects
from zmlcore.access.apikeys import create_key
from zmlcore.messages import RoutingInfo
from zmlcore.messages.keys import PlanLimits
from zmlcore.reply import routingmeta
from zmlcore.rpc import zml_pb2 as pb
from zmlcore.rpc import zml_pb2_grpc

LABEL = "équipe β"
CHAT = [{"role": "user", "content": "hello"}]
FIELDS = msgspec.structs.fields(RoutingInfo)
#: Fields every reply knows once the node has answered (the optional ones may be unknown at a
#: stream's start: total_tokens). The label is no header when empty (a request without one); the
#: metadata read back from the headers still equals the body's.
REQUIRED = [f.name for f in FIELDS if type(None) not in typing.get_args(f.type) and f.name != "label"]


@pytest.fixture(scope="module")
def keyed(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    stack = launch_stack(own_nats, tmp_path_factory.mktemp("routingmeta"), routers=1)

    async def make() -> str:
        nc = await nats.connect(own_nats)
        try:
            return (await create_key(nc, plan="custom", limits=PlanLimits(), label=LABEL))[0]
        finally:
            await nc.close()

    try:
        key = asyncio.run(make())
        deadline = time.monotonic() + 20
        while httpx.post(stack.gateway_url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                         json={"model": MODEL, "messages": CHAT, "max_tokens": 1}, timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never accepted the new key"
            time.sleep(0.1)
        yield stack, key
    finally:
        stack.stop()


def _headers(pairs: Mapping[str, str] | list[tuple[str, str | bytes]]) -> dict[str, str]:
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return {k.lower(): v for k, v in items if isinstance(v, str)}


def _body_info(zml_obj: Mapping[str, object]) -> RoutingInfo:
    assert set(zml_obj) == set(RoutingInfo.__struct_fields__)
    return msgspec.convert(zml_obj, RoutingInfo)


def _all_carried(headers: Mapping[str, str], prefix: str) -> RoutingInfo:
    """Every field's header is there (optional ones may be unknown yet); the typed metadata."""
    words = {name: f"{prefix}{nats.lower()[len('zml-'):]}" for name, nats, _ in routingmeta.FIELDS}
    missing = [words[name] for name in REQUIRED if words[name] not in headers]
    assert missing == [], f"not carried: {missing}"
    info = routingmeta.read(headers)
    assert info is not None
    assert info.router_id and info.node_id and info.attempts >= 1 and info.time_to_first_token is not None
    return info


def _same(a: RoutingInfo, b: object) -> None:
    for f in FIELDS:
        assert getattr(a, f.name) == getattr(b, f.name), f.name


def test_http_reply_and_stream(keyed: tuple[Stack, str]) -> None:
    stack, key = keyed
    auth = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.gateway_url, headers=auth, timeout=30) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
        assert r.status_code == 200, r.text
        body = _body_info(r.json()["zml"])
        assert body.label == LABEL and body.router_id and body.total_tokens
        assert _all_carried(_headers(r.headers), "x-zml-") == body  # every field, the same values
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            start = _all_carried(_headers(s.headers), "x-zml-")
            s.read()
        assert start.label == LABEL and start.node_id in stack.node_ids


async def test_grpc_reply_and_stream(keyed: tuple[Stack, str]) -> None:
    stack, key = keyed
    md = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        stub = zml_pb2_grpc.ZmlStub(channel)
        req = pb.InferRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content="hello")], max_tokens=4)
        call = stub.Infer(req, metadata=md)
        reply = await call
        body = _body_info(json.loads(reply.json)["zml"])
        assert body.label == LABEL
        for f in FIELDS:  # the zml.v1 Routing message, field by field (None: unset)
            value = getattr(body, f.name)
            if value is None:
                assert not reply.routing.HasField(f.name), f.name
            else:
                assert getattr(reply.routing, f.name) == value, f.name
        assert _all_carried(_headers(list(await call.trailing_metadata())), "zml-") == body
        stream = stub.InferStream(req, metadata=md)
        start = _all_carried(_headers(list(await stream.initial_metadata())), "zml-")
        assert [c async for c in stream] and start.label == LABEL


async def test_raw_nats_reply_and_stream(keyed: tuple[Stack, str]) -> None:
    stack, _ = keyed
    nc = await nats.connect(stack.nats_url)
    try:
        # As a front door would: on an open broker anyone may publish there (docs/security.md).
        payload = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 4}).encode()
        ask = {subjects.H_LABEL: "raw team"}
        msg = await nc.request(subjects.FRONT_DOOR_INFER, payload, timeout=10, headers=ask)
        body = _body_info(json.loads(msg.data)["zml"])
        assert body.label == "raw team"
        assert _all_carried(_headers(msg.headers), "zml-") == body
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.INFER, json.dumps({**json.loads(payload), "stream": True}).encode(), reply=inbox)
        start = await sub.next_msg(timeout=10)
        while not start.data:  # keepalives, if any
            start = await sub.next_msg(timeout=10)
        assert start.headers[subjects.H_STREAM] == "start"
        assert _all_carried(_headers(start.headers), "zml-") == _body_info(json.loads(start.data)["routing"])
    finally:
        await nc.close()


@pytest.mark.parametrize("scheme", ["http", "grpc", "nats"])
def test_the_sdk_gets_every_field(keyed: tuple[Stack, str], scheme: str) -> None:
    stack, key = keyed
    endpoint = {"http": stack.gateway_url, "grpc": f"grpc://{stack.grpc_target}", "nats": stack.nats_url}[scheme]
    label = "" if scheme == "nats" else LABEL  # NATS: no API key, so no label (zml_router.request.intake.drop_untrusted)
    with zml.Client(endpoint, api_key=key, max_retries=0) as client:
        r = client.infer(MODEL, messages=CHAT, max_tokens=4)
        assert isinstance(r.routing, zml.Routing)
        _same(_body_info(r.raw["zml"]), r.routing)
        assert r.routing.label == label and r.routing.router_id and r.routing.total_tokens
        with client.infer_stream(MODEL, messages=CHAT, max_tokens=4) as s:
            assert "".join(c.text for c in s)
        assert s.routing is not None
        assert s.routing.label == label and s.routing.router_id and s.routing.node_id in stack.node_ids
