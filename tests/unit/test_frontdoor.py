"""The gateway -> router body codec (zmlcore.messages.frontdoor) and the node's body (zml_router.node.attempt.NodeBodies):
how often a request body is parsed and encoded on its way to a node."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import msgspec
import pytest

from zmlcore import subjects
from zmlcore.messages import frontdoor
from zmlcore.messages import validate
from zmlcore.errors import BadRequestError
from zmlcore.messages import InlinePolicy
from zml_router.node import attempt

CHAT = [{"role": "user", "content": "hi"}]
OPENAI = json.dumps({"model": "m", "messages": CHAT, "max_tokens": 7, "top_p": 0.5}).encode()
SDK = json.dumps({"model": "m", "messages": CHAT, "request_id": "r1", "timeout_ms": 900,
                  "policy": {"strategy": "cost", "queue_on_saturation": True}, "accelerator_id": "n1"}).encode()


class _Counting:
    """Wraps a msgspec Decoder/encode function and counts its calls."""

    def __init__(self, inner: Any, counts: Counter[str], name: str) -> None:
        self.inner, self.counts, self.name = inner, counts, name

    def decode(self, raw: Any) -> Any:
        self.counts[self.name] += 1
        return self.inner.decode(raw)

    def __call__(self, obj: Any) -> bytes:
        self.counts[self.name] += 1
        return self.inner(obj)


@pytest.fixture()
def counts(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    c: Counter[str] = Counter()
    monkeypatch.setattr(validate, "infer_request_decoder", _Counting(validate.infer_request_decoder, c, "full decode"))
    monkeypatch.setattr(frontdoor, "_decode_any", _Counting(frontdoor._decode_any, c, "generic decode"))
    monkeypatch.setattr(frontdoor, "_front_door", _Counting(frontdoor._front_door, c, "small decode"))
    monkeypatch.setattr(frontdoor, "_encode", _Counting(frontdoor._encode, c, "encode"))
    monkeypatch.setattr(attempt, "_decode_any", _Counting(attempt._decode_any, c, "generic decode"))
    monkeypatch.setattr(attempt, "_encode", _Counting(attempt._encode, c, "encode"))
    return c


def _path(raw: bytes, node_names: list[str]) -> tuple[list[bytes], dict[str, str]]:
    """What the gateway and the router do to one body: the bodies the nodes tried get."""
    req = validate.decode_request(raw)                      # gateway: validation
    body, headers = frontdoor.split(raw, req)               # gateway: ZML fields -> headers
    rreq = frontdoor.decode(body, headers)                  # router: the small decode
    bodies = attempt.NodeBodies(body, rreq.model, headers.get(subjects.H_BODY) == subjects.BODY_CLEAN)
    return [bodies(name) for name in node_names], headers


def test_an_openai_body_is_parsed_once_per_process_and_never_encoded(counts: Counter[str]) -> None:
    """Before: gateway decode, router decode: 2 parses, the second a full one. Now the router's
    is the small one, and the node gets the caller's bytes."""
    sent, _ = _path(OPENAI, ["m", "m"])  # a failover to a second node: still the same bytes
    assert sent[0] is OPENAI and sent[1] is OPENAI
    assert counts == Counter({"full decode": 1, "small decode": 1})


def test_an_sdk_body_is_rewritten_once_at_the_gateway(counts: Counter[str]) -> None:
    """Before: 3 parses and 1 encode (router: decode + decode and re-encode to strip ZML's
    fields). Now the gateway strips them (one generic decode + encode), the router reads the
    clean body once and forwards it as it came."""
    sent, headers = _path(SDK, ["m"])
    assert json.loads(sent[0]) == {"model": "m", "messages": CHAT}
    assert counts == Counter({"full decode": 1, "generic decode": 1, "encode": 1, "small decode": 1})
    assert headers[subjects.H_ACCELERATOR_ID] == "n1"
    assert json.loads(headers[subjects.H_POLICY]) == {"name": "inline", "strategy": "cost", "queue_on_saturation": True}


def test_a_key_name_in_the_text_is_no_rewrite(counts: Counter[str]) -> None:
    """Before: the router decoded and re-encoded such a body for the node (3 parses, 1 encode):
    its byte test saw ``"policy"``. A null ZML field is stripped like any other."""
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "policy"}]}).encode()
    sent, _ = _path(raw, ["m"])
    assert sent[0] is raw
    assert counts == Counter({"full decode": 1, "small decode": 1})
    raw = json.dumps({"model": "m", "prompt": "x", "policy": None, "zml": {"node_id": "a"}}).encode()
    assert json.loads(_path(raw, ["m"])[0][0]) == {"model": "m", "prompt": "x"}


def test_served_names_are_rewritten_once_per_name(counts: Counter[str]) -> None:
    """Before: the alias rewrite (decode + encode) and again per attempt on a served_names node."""
    sent, _ = _path(OPENAI, ["engine/a.gguf", "engine/a.gguf", "m", "engine/b"])
    assert [json.loads(b)["model"] for b in sent] == ["engine/a.gguf", "engine/a.gguf", "m", "engine/b"]
    assert sent[0] is sent[1] and sent[2] is OPENAI
    assert counts == Counter({"full decode": 1, "small decode": 1, "generic decode": 1, "encode": 2})


def test_the_router_sees_what_the_body_said() -> None:
    req = validate.decode_request(SDK)
    body, headers = frontdoor.split(SDK, req)
    got = frontdoor.decode(body, {**headers, subjects.H_REQUEST_ID: "r1"})
    assert got.kind() == "chat" and got.model == "m" and got.stream is False
    assert got.accelerator_id == "n1" and got.policy == InlinePolicy(strategy="cost", queue_on_saturation=True)
    named = json.dumps({"model": "m", "prompt": None, "input": ["a", "b"], "routing": "fast"}).encode()
    body, headers = frontdoor.split(named, validate.decode_request(named))
    got = frontdoor.decode(body, headers)
    assert got.kind() == "embedding" and got.input == ["a", "b"] and got.policy == "fast" and got.prompt is None
    assert json.loads(body) == {"model": "m", "prompt": None, "input": ["a", "b"]}


def test_a_raw_body_is_stripped_for_the_node() -> None:
    """A raw zml.infer body (not clean): ZML's fields never reach the node."""
    bodies = attempt.NodeBodies(SDK, "m", clean=False)
    assert json.loads(bodies("m")) == {"model": "m", "messages": CHAT}
    assert json.loads(attempt.NodeBodies(OPENAI, "m", clean=False)("m")) == json.loads(OPENAI)


@pytest.mark.parametrize("raw, headers", [
    (b"{", {}), (b"[]", {}), (b'{"model": ""}', {}), (b'{"model": "m"}', {}),
    (b'{"model": "m", "prompt": "x", "input": "y"}', {}), (b'{"model": "m", "messages": null}', {}),
    (b'{"model": "m", "prompt": "x"}', {subjects.H_POLICY: "{"}),
    (b'{"model": "m", "prompt": "x"}', {subjects.H_POLICY: '{"nope": 1}'}),
    (b'{"model": "m", "prompt": "x", "stream": "yes"}', {}),
    (b'{"model": "m", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}", {}),
])
def test_hostile_front_door_input_is_a_bad_request(raw: bytes, headers: dict[str, str]) -> None:
    with pytest.raises(BadRequestError):
        frontdoor.decode(raw, headers)
