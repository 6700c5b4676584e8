"""Third-party clients through the gateway (issue 10 items 1 and 10): the openai package
streaming tokens that hold U+2028/U+2029/U+0085, embeddings routed to nodes serving an
embedding model (HTTP, raw NATS, SDK), GET /v1/models/{id}, and a pinned node's overload named
as policy ``pinned``."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import nats
import openai
import pytest

import zml
from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects
from zml_sim.embeddings import vector

EMBED = "BAAI/bge-small-en-v1.5"
CHAT = [{"role": "user", "content": "say something with line separators"}]


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("clients"), routers=1, poll_s=0.3,
                     fleet=[("h100-a", "nvidia_h100", [MODEL, EMBED]), ("mi300x-a", "amd_mi300x", [MODEL])],
                     extra=f'[models."{EMBED}"]\nembedding = true\n')
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture()
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield client
    finally:
        client.close()


def test_openai_stream_keeps_tokens_holding_line_separators(stack: Stack, oai: openai.OpenAI) -> None:
    stack.faults("h100-a", separator_tokens=True)
    try:
        pin = {"accelerator_id": "h100-a"}
        whole = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, extra_body=pin)  # type: ignore[arg-type]
        text = whole.choices[0].message.content or ""
        assert "\u2028" in text and "\u2029" in text and "\u0085" in text
        # Through the gateway the stream used to end at the first U+2028 (JSONDecodeError).
        stream = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True,  # type: ignore[arg-type]
                                             extra_body=pin)
        parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(parts) == text
        # The SDK over HTTP reads the same stream.
        with zml.Client(stack.gateway_url, max_retries=0) as client:
            with client.infer_stream(MODEL, messages=CHAT, max_tokens=12, accelerator_id="h100-a") as s:
                assert "".join(c.text for c in s) == text
    finally:
        stack.faults("h100-a", separator_tokens=False)


def _unit(v: list[float]) -> bool:
    return math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-3)


def test_openai_embeddings_through_the_gateway(stack: Stack, oai: openai.OpenAI) -> None:
    r = oai.embeddings.create(model=EMBED, input=["a cat", "a dog"])
    assert [d.index for d in r.data] == [0, 1]
    assert r.model == EMBED and r.usage.prompt_tokens > 0
    got = r.data[0].embedding
    assert len(got) == 384 and _unit(got)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, vector(EMBED, "a cat", 384)))
    assert r.data[0].embedding != r.data[1].embedding
    small = oai.embeddings.create(model=EMBED, input="a cat", dimensions=16, encoding_format="float")
    assert len(small.data[0].embedding) == 16
    raw = httpx.post(stack.gateway_url + "/v1/embeddings", json={"model": EMBED, "input": "x"}, timeout=30)
    assert raw.status_code == 200, raw.text
    assert raw.json()["zml"]["node_id"] == "h100-a"  # the only node serving it
    assert raw.headers["x-zml-node-id"] == "h100-a"


async def test_embeddings_over_raw_nats_and_the_sdk(stack: Stack) -> None:
    nc = await nats.connect(stack.nats_url)
    try:
        msg = await nc.request(subjects.INFER, json.dumps({"model": EMBED, "input": ["hello"]}).encode(), timeout=20)
        body = json.loads(msg.data)
        assert body["object"] == "list" and len(body["data"][0]["embedding"]) == 384
        assert body["zml"]["node_id"] == "h100-a"
    finally:
        await nc.close()
    for endpoint in (stack.gateway_url, stack.nats_url):
        async with zml.AsyncClient(endpoint, max_retries=0) as client:
            r = await client.embed(EMBED, ["hello", "world"], dimensions=32)
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 32 and _unit(r.embeddings[1])
        assert r.routing.node_id == "h100-a" and r.usage.prompt_tokens > 0
    with zml.Client(stack.gateway_url, max_retries=0) as sync:
        r2 = sync.embed(EMBED, "hello", encoding_format="base64")
    assert len(r2.embeddings[0]) == 384 and _unit(r2.embeddings[0])


def test_an_embeddings_reply_larger_than_the_bus_carries_is_delivered_whole(stack: Stack) -> None:
    # 800 vectors of 384 floats as JSON are ~6 MB; NATS carries 1 MB by default. The router
    # sends such replies in parts to the gateway (zmlcore.reply.bigreply; never lost after the work).
    r = httpx.post(stack.gateway_url + "/v1/embeddings", timeout=60,
                   json={"model": EMBED, "input": [f"text {i}" for i in range(800)]})
    assert r.status_code == 200, r.text[:300]
    data = r.json()["data"]
    assert len(data) == 800 and all(len(d["embedding"]) == 384 for d in data)
    assert [d["index"] for d in data] == list(range(800))
    small = httpx.post(stack.gateway_url + "/v1/embeddings", timeout=60,
                       json={"model": EMBED, "input": [f"text {i}" for i in range(800)], "dimensions": 8})
    assert small.status_code == 200 and len(small.json()["data"]) == 800


@pytest.mark.parametrize("path,body,word", [
    ("/v1/chat/completions", {"model": EMBED, "messages": CHAT}, "embedding model"),
    ("/v1/embeddings", {"model": MODEL, "input": "x"}, "not an embedding model"),
    ("/v1/embeddings", {"model": EMBED, "input": "x", "stream": True}, "not streamed"),
    ("/v1/embeddings", {"model": EMBED, "input": []}, "empty"),
    ("/v1/embeddings", {"model": EMBED, "input": [{"a": 1}]}, "input"),
    ("/v1/embeddings", {"model": EMBED, "input": "x", "messages": CHAT}, "exactly one"),
])
def test_embedding_requests_that_cannot_be_served_are_400(stack: Stack, path: str, body: dict, word: str) -> None:
    r = httpx.post(stack.gateway_url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert word in r.json()["error"]["message"]


def test_models_retrieve(stack: Stack, oai: openai.OpenAI) -> None:
    assert oai.models.retrieve(MODEL).id == MODEL
    assert oai.models.retrieve("llama-3-8b").id == MODEL  # an alias answers for its model
    assert oai.models.retrieve(EMBED).id == EMBED
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no/such-model")
    r = httpx.get(stack.gateway_url + "/v1/models/no/such-model", timeout=10)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "no/such-model" in err["message"]


def test_a_pinned_node_that_answers_429_names_policy_pinned(stack: Stack) -> None:
    stack.faults("mi300x-a", error_rate=1.0, error_status=429)
    try:
        r = httpx.post(stack.gateway_url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "accelerator_id": "mi300x-a"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "QUEUE_FULL"
        assert err["routing_context"]["policy"] == "pinned"
        assert "mi300x-a" in err["message"]
    finally:
        stack.faults("mi300x-a", error_rate=0.0, error_status=500)
