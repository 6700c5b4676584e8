"""The SDK's sans-I/O core: requests, replies, errors, streams and retry decisions, no server."""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
import pytest

import zml
from zml import _core
from zml._core import RawReply, SSEDecoder, build_infer, decode_error, decode_nats_stream, decode_reply, retry_delay
from zmlcore import errors as zerrors
from zmlcore.messages import InferRequest, RoutingInfo

MODEL = "meta-llama/llama-3-8b-instruct"
ROUTING = {"node_id": "h100-1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "balanced",
           "queue_depth_at_dispatch": 3, "decision_id": "d1", "request_id": "r1", "attempts": 1,
           "time_to_first_token": 0.05, "total_tokens": 12}


def reply(data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> RawReply:
    return RawReply(status=status, headers=headers or {}, body=json.dumps(data).encode())


# --- requests -------------------------------------------------------------------------------------


def test_build_prompt_is_a_completion_and_messages_a_chat() -> None:
    c = build_infer(model=MODEL, prompt="hi")
    assert c.kind == "completion" and c.http_path == "/v1/completions"
    assert c.body["max_tokens"] == 512 and c.body["temperature"] == 0.7 and c.body["stream"] is False
    c = build_infer(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert c.kind == "chat" and c.http_path == "/v1/chat/completions" and c.body["stream"] is True
    # The body is what the routers decode.
    req = msgspec.json.decode(c.encode(), type=InferRequest)
    assert req.request_id == c.request_id and req.timeout_ms == 30_000


def test_build_merges_defaults_then_call_arguments() -> None:
    c = build_infer(model=None, prompt="hi", defaults={"model": MODEL, "max_tokens": 7, "top_p": 0.5},
                    extra={"top_p": 0.9, "timeout": 5, "request_id": "abc"}, max_tokens=None)
    assert c.body["model"] == MODEL and c.body["max_tokens"] == 7 and c.body["top_p"] == 0.9
    assert c.request_id == "abc" and c.body["timeout_ms"] == 5000 and c.timeout_s == 5 + _core.grace_s(5) == 5.75
    # The routing metadata asked for once, in the body (where decode_reply reads it).
    assert c.nats_headers() == {"Zml-Request-Id": "abc", "Zml-Timeout-Ms": "5000", "Zml-Accept-Routing": "body"}
    assert build_infer(model=MODEL, prompt="hi", max_tokens=3, defaults={"max_tokens": 7}).body["max_tokens"] == 3


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "messages": []}])
def test_build_rejects_missing_or_double_input(kwargs: dict[str, Any]) -> None:
    with pytest.raises(zml.BadRequestError):
        build_infer(model=MODEL, **kwargs)
    with pytest.raises(zml.BadRequestError, match="model is required"):
        build_infer(model=None, prompt="x")


def test_build_policy_forms() -> None:
    pol = zml.Policy(name="p", accelerator_chain=["H100", "MI300X"], latency_target_ms=500, cost_priority="balanced")
    body = build_infer(model=MODEL, prompt="x", policy=pol).body
    assert body["policy"] == {"name": "p", "accelerator_chain": ["H100", "MI300X"], "latency_target_ms": 500,
                              "cost_priority": "balanced"}
    assert msgspec.json.decode(msgspec.json.encode(body), type=InferRequest).policy is not None
    assert build_infer(model=MODEL, prompt="x", policy="cost").body["policy"] == "cost"
    assert build_infer(model=MODEL, prompt="x", routing="latency").body["routing"] == "latency"


def test_response_format_forms() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        value: int
        confidence: float

    rf = _core.response_format_wire(Answer)
    assert rf is not None and rf["type"] == "json_schema" and rf["json_schema"]["name"] == "Answer"
    schema = {"type": "object", "properties": {"v": {"type": "integer"}}}
    assert _core.response_format_wire(schema) == {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    assert _core.response_format_wire({"type": "json_object"}) == {"type": "json_object"}
    assert _core.parse_output('{"value": 4, "confidence": 0.99}', Answer) == Answer(value=4, confidence=0.99)
    assert _core.parse_output('```json\n{"v": 1}\n```', schema) == {"v": 1}
    with pytest.raises(zml.BadRequestError):
        _core.response_format_wire(42)


def test_parse_failure_is_none_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zml"):
        assert _core.parse_output("not json", {"type": "object"}) is None
    assert "could not parse" in caplog.text


def test_estimate_tokens() -> None:
    assert _core.estimate_tokens({"prompt": "x" * 400, "max_tokens": 100}, 512) == 200
    assert _core.estimate_tokens({"messages": [{"role": "user", "content": "x" * 40}]}, 64) == 74


# --- replies --------------------------------------------------------------------------------------


def test_decode_chat_reply() -> None:
    call = build_infer(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    data = {"id": "c1", "model": MODEL, "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
            "finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
            "zml": ROUTING}
    r = decode_reply(reply(data), call)
    assert r.text == r.output_text == r.choices[0].message.content == "Hello"
    assert r.routing.node_id == "h100-1" and r.routing.queue_depth == 3 and r.routing.decision_id == "d1"
    assert (r.metadata.accelerator_id, r.metadata.routing_policy, r.metadata.time_to_first_token,
            r.metadata.queue_depth_at_dispatch, r.metadata.total_tokens) == ("h100-1", "balanced", 0.05, 3, 12)
    assert r.raw == data and r.id == "c1"


def test_decode_completion_reply_with_routing_from_headers() -> None:
    call = build_infer(model=MODEL, prompt="hi")
    headers = {"x-zml-node-id": "a100-1", "x-zml-family": "A100", "x-zml-policy": "cost", "x-zml-queue-depth": "2",
               "x-zml-decision-id": "d9", "x-zml-accelerator-type": "nvidia_a100"}
    r = decode_reply(reply({"choices": [{"text": "there"}]}, headers=headers), call)
    assert r.text == r.choices[0].message.content == "there"
    assert (r.routing.node_id, r.routing.family, r.routing.queue_depth_at_dispatch) == ("a100-1", "A100", 2)


@pytest.mark.parametrize("code", ["NO_HEALTHY_NODES", "MODEL_NOT_LOADED", "QUEUE_FULL", "AUTH_FAILED", "TIMEOUT",
                                  "RATE_LIMITED", "BAD_REQUEST", "BACKEND_ERROR", "POLICY_CONFIG", "INTERNAL",
                                  "CANCELLED"])
@pytest.mark.parametrize("transport", ["http", "grpc", "nats"])
def test_every_code_maps_to_its_class_on_every_transport(code: str, transport: str) -> None:
    cls = zerrors.error_class(code)
    ctx = {"policy": "p", "evaluated": [{"family": "H100", "nodes_checked": 3}], "final_error": "no_viable_node"}
    body = cls("boom", routing_context=ctx).to_body()
    payload = msgspec.json.encode(body)
    if transport == "http":
        raw = RawReply(status=cls.http_status, headers={"retry-after": "2"} if cls.retryable else {}, body=payload)
    elif transport == "grpc":  # what the gateway's gRPC front ends a failed call with
        import grpc

        from zml._transport_grpc import _error
        from zmlcore.rpc import status as rpc_status

        md = grpc.aio.Metadata(*rpc_status.error_metadata(payload, code, 2.0 if cls.retryable else None))
        got = _error(grpc.aio.AioRpcError(rpc_status.status_for(code), grpc.aio.Metadata(), md, "boom"), "t")
        assert isinstance(got, RawReply)
        raw = got
    else:
        headers = {"zml-error-code": code}
        raw = RawReply(status=_core.nats_status(headers), headers=headers, body=payload)
    call = build_infer(model=MODEL, prompt="x")
    with pytest.raises(zml.ZMLError) as ei:
        decode_reply(raw, call)
    exc = ei.value
    assert type(exc) is cls and exc.code == code and exc.routing_context == ctx
    assert "routing_context=" in str(exc) and '"final_error":"no_viable_node"' in str(exc)
    if transport in ("http", "grpc") and cls.retryable:
        assert exc.retry_after == 2.0


def test_seed_classes_and_hierarchy() -> None:
    assert issubclass(zml.RoutingError, zml.ZMLError) and issubclass(zml.PolicyConfigError, zml.ZMLError)
    for cls in (zml.NoHealthyNodesError, zml.ModelNotLoadedError, zml.QueueFullError):
        assert issubclass(cls, zml.RoutingError)
    assert zml.ConnectionError.code == "CONNECTION_FAILED" and zml.ConnectionError.retryable


def test_non_json_error_bodies_map_by_status() -> None:
    call = build_infer(model=MODEL, prompt="x")
    for status, cls in ((401, zml.AuthError), (429, zml.RateLimitError), (502, zml.BackendError),
                        (504, zml.TimeoutError), (500, zml.BackendError), (418, zml.BadRequestError)):
        with pytest.raises(cls):
            decode_reply(RawReply(status=status, headers={}, body=b"<html>oops</html>"), call)
    assert decode_error(RawReply(status=429, headers={"retry-after": "7"}, body=b"")).retry_after == 7.0


# --- streams --------------------------------------------------------------------------------------


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                             "finish_reason": finish}]}


def test_sse_decoder() -> None:
    dec = SSEDecoder()
    events = [dec.feed(line) for line in (
        f"data: {json.dumps(_chunk('Hel'))}", "", ": keep-alive", f"data: {json.dumps(_chunk('lo', 'stop'))}", "",
        'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}',
        "data: [DONE]")]
    kinds = [e.kind for e in events if e is not None]
    assert kinds == ["chunk", "chunk", "chunk", "end"] and dec.done
    texts = [e.chunk.text for e in events if e is not None and e.chunk is not None]
    assert texts == ["Hel", "lo", ""]
    usage = [e.usage for e in events if e is not None and e.usage is not None]
    assert usage and usage[0].total_tokens == 3
    err = SSEDecoder().feed('data: {"error": {"message": "node died", "code": "BACKEND_ERROR"}}')
    assert err is not None and err.kind == "error" and isinstance(err.error, zml.BackendError)


def test_nats_stream_messages() -> None:
    start = msgspec.json.encode({"routing": RoutingInfo(**ROUTING)})
    ev = decode_nats_stream({"zml-stream": "start"}, start)
    assert ev.kind == "start" and ev.routing is not None and ev.routing.node_id == "h100-1"
    ev = decode_nats_stream({"zml-stream": "chunk"}, json.dumps(_chunk("x")).encode())
    assert ev.kind == "chunk" and ev.chunk is not None and ev.chunk.text == "x"
    ev = decode_nats_stream({"zml-stream": "end"}, start)
    assert ev.kind == "end" and ev.routing is not None and ev.routing.total_tokens == 12
    body = msgspec.json.encode(zerrors.QueueFullError("full").to_body())
    ev = decode_nats_stream({"zml-stream": "error", "zml-error-code": "QUEUE_FULL"}, body)
    assert ev.kind == "error" and isinstance(ev.error, zml.QueueFullError)
    ev = decode_nats_stream({"status": "503"}, b"")
    assert ev.kind == "error" and isinstance(ev.error, zml.NoHealthyNodesError) and "zml up" in str(ev.error)


# --- retries --------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [zml.RateLimitError(), zml.QueueFullError(), zml.NoHealthyNodesError(),
                                 zml.BackendError(), zml.TimeoutError(), zml.ConnectionError(), zml.ZMLError()])
def test_transient_errors_back_off_exponentially(exc: zml.ZMLError) -> None:
    if exc.code == "INTERNAL":  # a bare 500 INTERNAL is not marked retryable by zmlcore
        assert retry_delay(exc, 0, 3, 0.0) is None
        return
    assert [retry_delay(exc, n, 10, 0.0) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert retry_delay(exc, 0, 3, 1.0) == 1.5
    assert retry_delay(exc, 3, 3, 0.0) is None  # max_retries reached
    assert retry_delay(exc, 0, 0, 0.0) is None


def test_retry_after_replaces_backoff_and_is_capped() -> None:
    assert retry_delay(zml.RateLimitError(retry_after=3), 2, 3, 0.9) == 3
    assert retry_delay(zml.RateLimitError(retry_after=600), 0, 3, 0.0) == 60


def test_an_slo_no_node_would_meet_even_idle_is_not_retried() -> None:
    # Without a Retry-After the router found no node that meets the target even idle: a client
    # retrying with the default backoff only waits ~7 s to hear the same answer.
    assert retry_delay(zml.SloUnattainableError("never"), 0, 3, 0.0) is None
    assert retry_delay(zml.SloUnattainableError("busy now", retry_after=2.5), 0, 3, 0.0) == 2.5
    assert retry_delay(zml.ShedError("shed"), 0, 3, 0.0) == 1  # (SHED is retried as before)


@pytest.mark.parametrize("exc", [zml.AuthError(), zml.BadRequestError(), zml.PolicyConfigError(),
                                 zml.ModelNotLoadedError(), zml.CancelledError(), ValueError("x")])
def test_non_transient_errors_are_never_retried(exc: BaseException) -> None:
    assert retry_delay(exc, 0, 3, 0.0) is None


def test_decode_nodes_and_models() -> None:
    nodes = {"nodes": [{"node_id": "a", "accelerator_type": "nvidia_h100", "family": "H100", "endpoint": "http://x",
                        "models": ["m1", "m2"], "status": "up", "cooldown_s": 3}]}
    raw = reply(nodes)
    assert _core.decode_nodes(raw)[0]["cooldown_s"] == 3
    assert _core.node_states(_core.decode_nodes(raw))[0].models == ["m1", "m2"]
    assert _core.decode_models(raw) == ["m1", "m2"]
    assert _core.decode_models(reply({"object": "list", "data": [{"id": "m3"}]})) == ["m3"]


def test_session_travels_as_a_header_on_http_and_nats() -> None:
    from zmlcore import subjects

    call = build_infer(model="m", prompt="hi", extra={"session": "conv-42"})
    assert call.http_headers()["x-session-id"] == "conv-42"
    assert call.nats_headers()[subjects.H_SESSION] == "conv-42"
    assert "session" not in call.body  # a header, not an OpenAI field
    plain = build_infer(model="m", prompt="hi")
    assert "x-session-id" not in plain.http_headers() and subjects.H_SESSION not in plain.nats_headers()
    for bad in ("", "a\nb", "x" * 300, 7):
        with pytest.raises(zerrors.ZMLError):
            build_infer(model="m", prompt="hi", extra={"session": bad})
