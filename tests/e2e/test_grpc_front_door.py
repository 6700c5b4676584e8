"""The gRPC front door's bounds with a real grpcio client: API keys, plan limits, deadlines,
cancellation, message and metadata size, a stream that fails midway.

A gateway of this module's own (keys, a small body limit, a per-key rate) on its own broker,
and a stand-in router in the routers' queue group that answers by model name and records
every request (with its Zml-Timeout-Ms) and every cancel, as the real router would see them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import nats
import pytest

from zmlcore import subjects
from zmlcore.runtime.launch import free_port, service_argv, spawn, wait_port
from zmlcore.rpc import zml_pb2 as pb
from zmlcore.rpc import zml_pb2_grpc
from zmlcore.bus.publish import flush

KEYS = ["k-ok", "k-deadline", "k-cancel", "k-stream", "k-limit", "k-size", "k-session"]
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}


@pytest.fixture(scope="module")
def target(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = Path(tmp_path_factory.mktemp("grpc-door"))
    port, grpc_port = free_port(), free_port()
    (folder / "zml.toml").write_text(
        "[defaults]\nrequest_timeout_s = 10\n"
        f"[gateway]\napi_keys = {json.dumps(KEYS)}\nmax_body_bytes = 65536\nrequests_per_minute = 60\n"
        f"request_burst = 3\nrouter_keepalive_ms = 0\ngrpc_port = {grpc_port}\nmax_header_bytes = 8192\n")
    proc = spawn("gateway", service_argv("gateway", str(folder / "zml.toml"), own_nats, "--port", str(port)))
    try:
        for _ in range(150):
            if wait_port("127.0.0.1", grpc_port, 0.2):
                break
            assert proc.alive(), proc.tail(30)
        yield f"127.0.0.1:{grpc_port}"
        assert proc.alive(), proc.tail(30)  # nothing here may kill it
    finally:
        proc.stop()


class Seen:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []  # (request id, NATS headers)
        self.cancels: list[str] = []

    async def cancelled(self, request_id: str, within_s: float = 10.0) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if request_id in self.cancels:
                return True
            await asyncio.sleep(0.05)
        return False


def _chunk(text: str) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}).encode()


@pytest.fixture()
async def router(own_nats: str) -> AsyncIterator[Seen]:
    """``ok``: answers at once; ``silent``: never answers; ``stall``: streams one chunk and
    stalls; ``fail``: streams one chunk, then a BACKEND_ERROR."""
    seen = Seen()
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        headers = dict(msg.headers or {})
        rid = headers.get(subjects.H_REQUEST_ID, "")
        seen.requests.append((rid, headers))
        body = json.loads(msg.data)
        model = body["model"]
        if model == "ok":
            reply = {"id": "c", "object": "chat.completion", "model": model, "usage": {"prompt_tokens": 1,
                     "completion_tokens": 1, "total_tokens": 2},
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}],
                     "zml": {**ROUTING, "request_id": rid}}
            await nc.publish(msg.reply, json.dumps(reply).encode(), headers={subjects.H_NODE_ID: "n1",
                                                                              subjects.H_REQUEST_ID: rid})
        elif model in ("stall", "fail"):
            start = json.dumps({"routing": {**ROUTING, "request_id": rid}}).encode()
            await nc.publish(msg.reply, start, headers={subjects.H_STREAM: "start", subjects.H_NODE_ID: "n1",
                                                        subjects.H_SEQ: "0"})
            await nc.publish(msg.reply, _chunk("one "), headers={subjects.H_STREAM: subjects.STREAM_CHUNK,
                                                                 subjects.H_SEQ: "1"})
            if model == "fail":
                err = {"error": {"message": "node n1 failed mid-stream", "type": "server_error",
                                 "code": "BACKEND_ERROR"}}
                await nc.publish(msg.reply, json.dumps(err).encode(), headers={
                    subjects.H_STREAM: subjects.STREAM_ERROR, subjects.H_ERROR_CODE: "BACKEND_ERROR"})

    async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
        seen.cancels.append(msg.subject.rsplit(".", 1)[-1])

    subs = [await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=serve),
            await nc.subscribe(subjects.cancel("*"), cb=on_cancel),
            await nc.subscribe(subjects.cancel("*", "*"), cb=on_cancel)]
    await flush(nc)
    try:
        yield seen
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


def _key(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _req(model: str, **kw: object) -> pb.InferRequest:
    return pb.InferRequest(model=model, messages=[pb.ChatMessage(role="user", content="hi")], **kw)  # type: ignore[arg-type]


@pytest.fixture()
async def stub(target: str) -> AsyncIterator[zml_pb2_grpc.ZmlStub]:
    async with grpc.aio.insecure_channel(target) as channel:
        yield zml_pb2_grpc.ZmlStub(channel)


async def test_api_keys(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    for metadata in ((), _key("k-wrong"), (("authorization", "k-ok"),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Infer(_req("ok"), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(info.value.trailing_metadata())["zml-code"] == "AUTH_FAILED"
    assert not router.requests  # refused before the bus
    for list_call, request in ((stub.ListModels, pb.ListModelsRequest()), (stub.ListNodes, pb.ListNodesRequest())):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await list_call(request)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await list_call(request, metadata=_key("k-ok"))).json  # with a key: the (empty) fleet
    call = stub.Infer(_req("ok"), metadata=_key("k-ok"))
    reply = await call
    assert reply.choices[0].text == "fine" and reply.routing.node_id == "n1"
    trailing = dict(await call.trailing_metadata())
    assert trailing["x-ratelimit-limit-requests"] == "60"  # the plan's headers, as over HTTP


async def test_a_session_in_metadata_reaches_the_routers(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    """``x-session-id`` call metadata is the conversation, as the HTTP header is (Zml-Session);
    other metadata stays out of the request."""
    await stub.Infer(_req("ok", request_id="s-1"), metadata=(*_key("k-session"), ("x-session-id", "conv-7"),
                                                             ("x-other", "no")))
    await stub.Infer(_req("ok", request_id="s-2"), metadata=_key("k-session"))
    # an oversized one is cut to the bound, as over HTTP
    await stub.Infer(_req("ok", request_id="s-3"), metadata=(*_key("k-session"), ("x-session-id", "c" * 2000)))
    got = {rid: headers for rid, headers in router.requests}
    assert got["s-1"][subjects.H_SESSION] == "conv-7" and subjects.H_SESSION not in got["s-2"]
    assert got["s-3"][subjects.H_SESSION] == "c" * subjects.MAX_SESSION_ID
    assert not any("other" in name.lower() for name in got["s-1"])


async def test_plan_limit_is_resource_exhausted_with_retry_after(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    codes = []
    for _ in range(5):
        try:
            await stub.Infer(_req("ok"), metadata=_key("k-limit"))
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            md = dict(exc.trailing_metadata())
            assert md["zml-code"] == "RATE_LIMITED" and float(md["zml-retry-after"]) > 0
    assert codes[:3] == [grpc.StatusCode.OK] * 3 and grpc.StatusCode.RESOURCE_EXHAUSTED in codes[3:], codes


async def test_deadline_is_the_timeout_and_cancels_upstream(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Infer(_req("silent", request_id="dl-1"), metadata=_key("k-deadline"), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    (rid, headers), = router.requests
    assert rid == "dl-1" and 0 < int(headers[subjects.H_TIMEOUT_MS]) <= 1100  # the deadline became the timeout
    # (gRPC sends the deadline as a timeout rounded up a little)
    assert await router.cancelled("dl-1")  # and the request was cancelled on its node


async def test_client_cancel_mid_stream_cancels_upstream(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    call = stub.InferStream(_req("stall", request_id="cx-1"), metadata=_key("k-cancel"))
    first = await call.read()
    assert first.text == "one "
    call.cancel()
    assert await router.cancelled("cx-1")


async def test_stream_failing_midway_ends_with_the_zml_status(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    call = stub.InferStream(_req("fail"), metadata=_key("k-stream"))
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for chunk in call:
            got.append(chunk.text)
    assert got == ["one "]  # what came before the failure, then the error: never a short "success"
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    md = dict(info.value.trailing_metadata())
    assert md["zml-code"] == "BACKEND_ERROR" and md["zml-node-id"] == "n1"
    assert "failed mid-stream" in info.value.details()


async def test_size_bounds(stub: zml_pb2_grpc.ZmlStub, router: Seen) -> None:
    # Over the message limit (max_body_bytes): refused by gRPC before it is decoded.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Infer(_req("ok", extra_json=json.dumps({"stop": ["x" * 70_000]}).encode()), metadata=_key("k-size"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Under it as protobuf, over it as the JSON body (every quote escaped): the gateway's 413.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Infer(pb.InferRequest(model="ok", prompt='"' * 40_000), metadata=_key("k-size"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())["zml-code"] == "REQUEST_TOO_LARGE"
    # Metadata over max_header_bytes: refused, and the server goes on.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Infer(_req("ok"), metadata=(*_key("k-size"), ("x-junk", "j" * 20_000)))
    assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                 grpc.StatusCode.UNAVAILABLE)
    assert not router.requests
    reply = await stub.Infer(_req("ok"), metadata=_key("k-size"))
    assert reply.choices[0].text == "fine"
