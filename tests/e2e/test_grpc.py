"""The gateway's gRPC front (zml.v1.Zml) with a real grpcio client against the real stack.

Same path as HTTP: the same replies and routing metadata, the same errors as gRPC status plus
``zml-code``, hostile input refused with a status (never a crash). Auth, deadlines,
cancellation and size bounds are in test_grpc_front_door.py (a gateway with keys and a
stand-in router that records cancels).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from zmlcore.rpc import zml_pb2 as pb
from zmlcore.rpc import zml_pb2_grpc
from conftest import MODEL, Stack


@pytest.fixture()
async def stub(zml_stack: Stack) -> AsyncIterator[zml_pb2_grpc.ZmlStub]:
    async with grpc.aio.insecure_channel(zml_stack.grpc_target) as channel:
        yield zml_pb2_grpc.ZmlStub(channel)


def _md(call_md: object) -> dict[str, str | bytes]:
    return {k: v for k, v in (call_md or ())}  # type: ignore[attr-defined]


async def test_infer_chat_reply_and_routing_metadata(stub: zml_pb2_grpc.ZmlStub) -> None:
    call = stub.Infer(pb.InferRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content="hello there")],
                                      max_tokens=8, policy="latency", request_id="grpc-chat-1"))
    reply = await call
    trailing = _md(await call.trailing_metadata())
    assert reply.choices and reply.choices[0].text and reply.choices[0].role == "assistant"
    assert reply.usage.completion_tokens > 0 and reply.usage.total_tokens >= reply.usage.completion_tokens
    body = json.loads(reply.json)  # the HTTP body, byte for byte
    assert body["choices"][0]["message"]["content"] == reply.choices[0].text
    assert reply.routing.node_id and reply.routing.policy == "latency" and reply.routing.request_id == "grpc-chat-1"
    assert trailing["zml-node-id"] == reply.routing.node_id
    assert trailing["zml-request-id"] == "grpc-chat-1" and trailing["zml-policy"] == "latency"
    assert await call.code() == grpc.StatusCode.OK


async def test_infer_completions_and_extra_fields(stub: zml_pb2_grpc.ZmlStub) -> None:
    reply = await stub.Infer(pb.InferRequest(model="llama-3-8b", prompts=["one", "two"], max_tokens=4,
                                             extra_json=json.dumps({"top_p": 0.5, "seed": 3}).encode()))
    assert reply.choices and all(c.text for c in reply.choices)  # (the sim answers a prompt list once)
    assert json.loads(reply.json)["object"] == "text_completion" and reply.model == MODEL


async def test_infer_stream_chunks_and_metadata(stub: zml_pb2_grpc.ZmlStub) -> None:
    call = stub.InferStream(pb.InferRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content="count")],
                                            max_tokens=12))
    initial = _md(await call.initial_metadata())
    chunks = [c async for c in call]
    trailing = _md(await call.trailing_metadata())
    assert await call.code() == grpc.StatusCode.OK
    assert initial["zml-node-id"] and trailing["zml-node-id"] == initial["zml-node-id"]
    text = "".join(c.text for c in chunks)
    assert text and sum(1 for c in chunks if c.finish_reason) == 1
    assert all(json.loads(c.json)["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize(("request_", "status", "code"), [
    (pb.InferRequest(model="no/such-model", prompt="hi"), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_LOADED"),
    (pb.InferRequest(prompt="hi"), grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="a", prompts=["b"]), grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, messages=[pb.ChatMessage(role="robot", content="x")]),
     grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", extra_json=b"{not json"), grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", extra_json=b"[1]"), grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", extra_json=b'{"prompt": "again"}'),
     grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", extra_json=b'{"stream": true}'),
     grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", extra_json=b"[" * 5000 + b"]" * 5000),
     grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", request_id="has spaces.and.dots"),
     grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
    (pb.InferRequest(model=MODEL, prompt="hi", policy="no-such-policy"), grpc.StatusCode.INVALID_ARGUMENT,
     "POLICY_CONFIG"),
])
@pytest.mark.parametrize("method", ["Infer", "InferStream"])
async def test_errors_are_status_and_zml_code(stub: zml_pb2_grpc.ZmlStub, method: str, request_: pb.InferRequest,
                                              status: grpc.StatusCode, code: str) -> None:
    call = getattr(stub, method)(request_)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if method == "Infer":
            await call
        else:
            [c async for c in call]
    err = info.value
    trailing = _md(err.trailing_metadata())
    assert err.code() == status, (err.code(), err.details())
    assert trailing["zml-code"] == code
    body = msgspec.json.decode(trailing["zml-error-bin"])
    assert body["error"]["code"] == code and body["error"]["message"] == err.details()


async def test_malformed_protobuf_is_invalid_argument(zml_stack: Stack) -> None:
    async with grpc.aio.insecure_channel(zml_stack.grpc_target) as channel:
        for path in ("/zml.v1.Zml/Infer", "/zml.v1.Zml/InferStream"):
            raw = channel.unary_unary(path) if path.endswith("Infer") else channel.unary_stream(path)
            for junk in (b"\xff\xff\xff\xff", b"\x0a\xff\x01", b"\x0a\x02\xc3\x28"):  # bad tag, short, bad UTF-8
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    call = raw(junk)
                    if path.endswith("Infer"):
                        await call
                    else:
                        [c async for c in call]
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert _md(info.value.trailing_metadata())["zml-code"] == "BAD_REQUEST"
        unknown = channel.unary_unary("/zml.v1.Zml/NoSuchMethod")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await unknown(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # and the service still answers
        reply = await zml_pb2_grpc.ZmlStub(channel).Infer(pb.InferRequest(model=MODEL, prompt="ok", max_tokens=2))
        assert reply.choices


async def test_server_reflection_lists_the_service(zml_stack: Stack) -> None:
    async with grpc.aio.insecure_channel(zml_stack.grpc_target) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = [a async for a in refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="zml.v1.Zml")]))]
    names = {s.name for s in answers[0].list_services_response.service}
    assert "zml.v1.Zml" in names
    assert answers[1].file_descriptor_response.file_descriptor_proto  # what grpcurl describes the API from


async def test_list_models_and_nodes(stub: zml_pb2_grpc.ZmlStub, zml_stack: Stack) -> None:
    models = await stub.ListModels(pb.ListModelsRequest())
    by_id = {m.id: m for m in models.models}
    assert MODEL in by_id and by_id[MODEL].nodes_up
    assert json.loads(models.json)["object"] == "list"
    nodes = await stub.ListNodes(pb.ListNodesRequest())
    assert {n.node_id for n in nodes.nodes} == set(zml_stack.node_ids)
    assert all(n.status and n.accelerator_type and n.models for n in nodes.nodes)
    assert len(json.loads(nodes.json)["nodes"]) == len(zml_stack.node_ids)


def test_doc_example_runs(zml_stack: Stack, tmp_path: Path) -> None:
    """The grpcio example in docs/grpc.md runs as written (pointed at the test stack)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "grpc.md").read_text()
    code = re.search(r"## Example \(Python, grpcio\)\n\n.*?```python\n(.*?)```", doc, re.S).group(1)  # type: ignore[union-attr]
    script = tmp_path / "example.py"
    script.write_text(code.replace("127.0.0.1:50051", zml_stack.grpc_target))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.search(r"\| node: (h100|a100|mi300x|gaudi2)-\d (H100|A100|MI300X|Gaudi2)", lines[0]), lines
    assert lines[1].strip() and lines[2] == "NOT_FOUND MODEL_NOT_LOADED", lines


async def test_doc_grpcurl_request_is_a_valid_infer_request(stub: zml_pb2_grpc.ZmlStub) -> None:
    """grpcurl isn't installable here: the doc's `-d` JSON, read with protobuf's JSON mapping
    (the one grpcurl uses), makes a request the service answers."""
    from google.protobuf import json_format

    doc = (Path(__file__).resolve().parents[2] / "docs" / "grpc.md").read_text()
    body = re.search(r"-d '(\{.*?\})' 127\.0\.0\.1:50051 zml\.v1\.Zml/Infer\n", doc, re.S).group(1)  # type: ignore[union-attr]
    req = json_format.Parse(body, pb.InferRequest())
    assert req.max_tokens == 32 and req.policy == "latency"
    reply = await stub.Infer(req)
    assert reply.choices[0].text and reply.routing.policy == "latency"
    streamed = json_format.Parse('{"model": "llama-3-8b", "prompt": "Once upon", "extra_json": "eyJ0b3BfcCI6IDAuOX0="}',
                                 pb.InferRequest())  # base64 of {"top_p": 0.9}, as the doc's printf | base64 makes
    assert json.loads(streamed.extra_json) == {"top_p": 0.9}
    assert "".join([c.text async for c in stub.InferStream(streamed)])


# --- hostile input, generated -------------------------------------------------------------------

_text = st.text(max_size=30) | st.sampled_from(["", " ", "a.b", "é", "\x00", "x" * 300, "\u2028", "*", ">"])
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _text,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                     max_leaves=10)


@st.composite
def _hostile(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))  # not protobuf at all, mostly
    req = pb.InferRequest(model=draw(st.sampled_from(["nope", "", "m" * 5000]) | _text))
    for _ in range(draw(st.integers(0, 2))):
        req.messages.add(role=draw(st.sampled_from(["user", "robot", ""]) | _text), content=draw(_text))
    req.prompt = draw(_text)
    req.prompts.extend(draw(st.lists(_text, max_size=2)))
    if draw(st.booleans()):
        req.max_tokens = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        req.temperature = draw(st.floats())
    req.policy = draw(st.sampled_from(["", "latency", "nope"]) | _text)
    req.request_id = draw(st.sampled_from(["", "ok-1"]) | _text)
    if draw(st.booleans()):
        req.timeout_ms = draw(st.integers(0, 2**32 - 1))
    extra = draw(st.none() | _json | st.binary(max_size=50))
    if extra is not None:
        req.extra_json = extra if isinstance(extra, bytes) else json.dumps(extra).encode()
    return req.SerializeToString()


_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS}


def test_fuzzed_requests_get_a_status_never_a_crash(zml_stack: Stack) -> None:
    """Generated hostile messages (random bytes, hostile field values; never a valid model, so
    nothing reaches a node): each one a refusal with a ZML code, none INTERNAL/UNKNOWN, and the
    service answers a valid request afterwards."""
    seen: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(zml_stack.grpc_target) as channel:
        calls = {"Infer": channel.unary_unary("/zml.v1.Zml/Infer"),
                 "InferStream": channel.unary_stream("/zml.v1.Zml/InferStream")}

        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(raw=_hostile(), method=st.sampled_from(sorted(calls)))
        def one(raw: bytes, method: str) -> None:
            try:
                call = calls[method](raw, timeout=10)
                list(call) if method == "InferStream" else call  # noqa: B018
                raise AssertionError(f"accepted: {raw!r}")
            except grpc.RpcError as exc:
                seen.add(exc.code())
                assert exc.code() in _REFUSALS, (exc.code(), exc.details(), raw)
                assert dict(exc.trailing_metadata() or ())["zml-code"], raw

        one()
        reply = zml_pb2_grpc.ZmlStub(channel).Infer(pb.InferRequest(model=MODEL, prompt="still there", max_tokens=2))
        assert reply.choices
    assert grpc.StatusCode.INVALID_ARGUMENT in seen
