"""zml.v1 <-> JSON bodies and ZML codes <-> gRPC statuses (zmlcore.rpc.codec), without a server;
and the committed generated modules match proto/zml/v1/zml.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _generate_module() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("zml_proto_generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_reads_meaning_not_the_generators_version() -> None:
    """Another grpcio-tools release writes other version strings: same meaning. A changed RPC,
    field or descriptor is not."""
    gen: Any = _generate_module()
    out = ROOT / "libs" / "zmlcore" / "src" / "zmlcore" / "rpc"
    grpc_text = (out / "zml_pb2_grpc.py").read_text()
    rpcs, classes, _ = gen.meaning("zml_pb2_grpc.py", grpc_text)
    assert ("unary_stream", "/zml.v1.Zml/InferStream", "InferRequest", "InferChunk") in rpcs
    assert "ZmlStub" in classes
    bumped = grpc_text.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9")
    assert gen.meaning("zml_pb2_grpc.py", bumped) == gen.meaning("zml_pb2_grpc.py", grpc_text)
    renamed = grpc_text.replace("'/zml.v1.Zml/ListNodes'", "'/zml.v1.Zml/ListAllNodes'")
    assert gen.meaning("zml_pb2_grpc.py", renamed) != gen.meaning("zml_pb2_grpc.py", grpc_text)

    pb2 = (out / "zml_pb2.py").read_text()
    other_runtime = pb2.replace("# Protobuf Python Version: ", "# Protobuf Python Version: 99")
    assert gen.meaning("zml_pb2.py", other_runtime) == gen.meaning("zml_pb2.py", pb2)
    assert gen.meaning("zml_pb2.py", pb2.replace("max_tokens", "max_tokenz")) != gen.meaning("zml_pb2.py", pb2)

    pyi = (out / "zml_pb2.pyi").read_text()
    assert gen.meaning("zml_pb2.pyi", pyi.replace("    model: str", "    model: int", 1)) != gen.meaning("zml_pb2.pyi", pyi)
    assert gen.meaning("zml_pb2.pyi", pyi.replace("\n\n", "\n\n\n")) == gen.meaning("zml_pb2.pyi", pyi)


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


def test_install_floors_admit_no_runtime_the_generated_modules_refuse() -> None:
    """The committed modules refuse, at import, a grpcio older than the grpcio-tools that wrote
    them and a protobuf older than its protoc: pyproject's floors must not allow either."""
    import re
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {m.group(1): tuple(int(x) for x in m.group(2).split("."))
              for d in deps if (m := re.fullmatch(r"(grpcio|protobuf)>=([\d.]+)", d))}
    out = ROOT / "libs" / "zmlcore" / "src" / "zmlcore" / "rpc"
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (out / "zml_pb2_grpc.py").read_text())
    pb_gen = re.search(r"# Protobuf Python Version: ([\d.]+)", (out / "zml_pb2.py").read_text())
    assert grpc_gen and pb_gen
    assert floors["grpcio"] >= tuple(int(x) for x in grpc_gen.group(1).split(".")), floors
    assert floors["protobuf"] >= tuple(int(x) for x in pb_gen.group(1).split(".")), floors
