"""zml.v1 <-> JSON bodies and ZML codes <-> gRPC statuses (zmlcore.rpc.codec), without a server;
and the committed generated modules match proto/zml/v1/zml.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import msgspec
import pytest

from zml import Policy
from zml._core import build_embed, build_infer
from zmlcore import errors
from zmlcore.errors import BadRequestError
from zmlcore.rpc import codec
from zmlcore.rpc import status as rpc_status
from zmlcore.rpc import zml_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_match_the_proto() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_every_zml_code_has_a_grpc_status() -> None:
    codes = {getattr(errors, name).code for name in errors.__all__
             if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), errors.ZMLError)}
    assert codes <= set(rpc_status.GRPC_STATUS), codes - set(rpc_status.GRPC_STATUS)
    assert rpc_status.status_for("QUEUE_FULL") == grpc.StatusCode.UNAVAILABLE
    assert rpc_status.status_for("SOMETHING_NEW") == grpc.StatusCode.UNKNOWN
    # retryable codes are UNAVAILABLE (what gRPC retry policies retry), or quota / deadline
    for code, status in rpc_status.GRPC_STATUS.items():
        if errors.error_class(code).retryable:
            assert status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.DEADLINE_EXCEEDED), code


@pytest.mark.parametrize("call", [
    build_infer(model="m", prompt="hi", max_tokens=5, temperature=0.0, routing="latency", accelerator_id="n1",
                extra={"top_p": 0.9, "stop": ["\n"], "request_id": "r-1", "timeout": 3}),
    build_infer(model="m", prompt=["a", "b"]),
    build_infer(model="m", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi",
                                                                               "name": "ann"}],
                policy=Policy(name="p", accelerator_chain=["H100", "MI300X"], latency_target_ms=500,
                              cost_priority="balanced"), stream=True),
    build_infer(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                policy={"strategy": "weighted", "accelerator_preference": [{"family": "H100"}]},
                response_format={"type": "json_object"}),
    build_embed(model="e", input=["a cat", "a dog"], dimensions=8),
], ids=["completion", "prompts", "chat-policy", "parts-extra", "embeddings"])
def test_sdk_body_survives_the_round_trip(call) -> None:  # type: ignore[no-untyped-def]
    req = codec.request_from_body(call.body)
    req = pb.InferRequest.FromString(req.SerializeToString())  # as it crosses the wire
    path, body = codec.request_body(req, stream=call.stream)
    assert path == call.http_path
    want = dict(call.body)
    if not want.get("stream"):
        want.pop("stream", None)
    assert msgspec.json.decode(body) == msgspec.json.decode(msgspec.json.encode(want))


def test_deadline_caps_the_timeout() -> None:
    req = pb.InferRequest(model="m", prompt="x", timeout_ms=5000)
    assert msgspec.json.decode(codec.request_body(req, stream=False, timeout_cap_ms=800)[1])["timeout_ms"] == 800
    assert msgspec.json.decode(codec.request_body(req, stream=False, timeout_cap_ms=9000)[1])["timeout_ms"] == 5000
    req = pb.InferRequest(model="m", prompt="x")
    assert msgspec.json.decode(codec.request_body(req, stream=False, timeout_cap_ms=700)[1])["timeout_ms"] == 700
    assert "timeout_ms" not in msgspec.json.decode(codec.request_body(req, stream=False)[1])


@pytest.mark.parametrize("extra", [b"{", b"[]", b'"s"', b'{"prompt": "y"}', b'{"stream": false}', b"[" * 100])
def test_bad_extra_json_is_a_bad_request(extra: bytes) -> None:
    with pytest.raises(BadRequestError):
        codec.request_body(pb.InferRequest(model="m", prompt="x", extra_json=extra), stream=False)


def test_replies_keep_their_json_whatever_the_shape() -> None:
    for junk in (b"", b"nope", b"[1,2]", b'{"choices": "x"}', b'{"choices": [{"index": -1, "message": {"content": 3}}]}'):
        assert codec.reply_from_json(junk).json == junk
        assert codec.chunk_from_json(junk).json == junk
    r = codec.reply_from_json(b'{"id": "c", "model": "m", "choices": [{"index": 0, "text": "hey", "finish_reason": "stop"}],'
                              b'"usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},'
                              b'"zml": {"node_id": "n", "policy": "latency", "queue_depth_at_dispatch": 2,'
                              b'"decision_id": "d", "time_to_first_token": 0.5, "router_id": "r1"}}')
    assert r.choices[0].text == "hey" and r.usage.total_tokens == 3
    assert r.routing.node_id == "n" and r.routing.time_to_first_token == 0.5 and not r.routing.HasField("total_tokens")
    c = codec.chunk_from_json(b'{"choices": [{"index": 1, "delta": {"content": "x"}, "finish_reason": null}]}')
    assert c.text == "x" and c.index == 1 and not c.HasField("usage")
