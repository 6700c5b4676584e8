"""The whole path through the HTTP gateway: gateway -> NATS -> router -> sim node -> reply."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import MODEL, MODEL_2, Stack

CHAT = [{"role": "user", "content": "Explain tensor parallelism in two sentences."}]


@pytest.fixture()
def http(zml_stack: Stack):
    with httpx.Client(base_url=zml_stack.gateway_url, timeout=30) as client:
        yield client


def test_chat_completion_has_text_usage_and_routing_metadata(http: httpx.Client, zml_stack: Stack) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    text = body["choices"][0]["message"]["content"]
    zml = body["zml"]
    assert zml["node_id"] in zml_stack.node_ids
    assert f"[{zml['node_id']}]" in text  # the sim says which node produced the text
    assert body["usage"]["completion_tokens"] == 12
    assert zml["total_tokens"] == body["usage"]["total_tokens"]
    assert zml["policy"] and zml["decision_id"] and zml["accelerator_type"].startswith(("nvidia", "amd", "intel"))
    assert isinstance(zml["queue_depth_at_dispatch"], int)
    assert zml["time_to_first_token"] > 0
    # The same metadata as headers.
    assert r.headers["x-zml-node-id"] == zml["node_id"]
    assert r.headers["x-zml-decision-id"] == zml["decision_id"]
    assert r.headers["x-zml-accelerator-type"] == zml["accelerator_type"]
    assert r.headers["x-zml-policy"] == zml["policy"]
    assert int(r.headers["x-zml-queue-depth"]) == zml["queue_depth_at_dispatch"]


def test_completions_endpoint(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 5


def test_alias_and_second_model(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": "llama-3-8b", "messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    r = http.post("/v1/chat/completions", json={"model": MODEL_2, "messages": CHAT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["zml"]["node_id"] in ("h100-1", "mi300x-1")


def test_streaming_sse_ends_with_done_and_carries_usage(http: httpx.Client, zml_stack: Stack) -> None:
    payload = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "stream": True,
               "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-zml-node-id"] in zml_stack.node_ids
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text.startswith("[")
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 8


def test_pinned_node(http: httpx.Client) -> None:
    for _ in range(3):
        r = http.post("/v1/chat/completions",
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "accelerator_id": "mi300x-2"})
        assert r.status_code == 200, r.text
        assert r.json()["zml"]["node_id"] == "mi300x-2"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "BAD_REQUEST"),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, "BAD_REQUEST"),  # no model
        (b'{"model": 42, "messages": []}', 400, "BAD_REQUEST"),  # wrong type
        (b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": "many"}', 400, "BAD_REQUEST"),
        (b'{"model": "' + MODEL.encode() + b'", "max_tokens": 3}', 400, "BAD_REQUEST"),  # no messages/prompt
        (b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "timeout_ms": -5}', 400, "BAD_REQUEST"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, "MODEL_NOT_LOADED"),
        (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "x"}], "policy": "nope"}',
         400, "POLICY_CONFIG"),
        (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "x"}], '
         b'"accelerator_id": "nope"}', 400, "BAD_REQUEST"),
    ],
)
def test_bad_input_gets_a_coded_error_and_the_service_keeps_serving(
    http: httpx.Client, body: bytes, status: int, code: str | None
) -> None:
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if code:
        assert err["code"] == code
    ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1})
    assert ok.status_code == 200


def test_an_unknown_model_is_one_story_and_no_hint_that_cannot_work(http: httpx.Client) -> None:
    """Issue 27 item 5b: a request said "run zml serve gpt-5", which said no node is configured
    for it, and GET /v1/models/gpt-5 said it does not exist: now all say the last."""
    r = http.post("/v1/chat/completions", json={"model": "gpt-5", "messages": CHAT})
    got = http.get("/v1/models/gpt-5")
    assert r.status_code == got.status_code == 404, (r.text, got.text)
    said = "The model 'gpt-5' does not exist: no node serves it or is configured to (GET /v1/models lists the models)"
    assert r.json()["error"]["message"] == got.json()["error"]["message"] == said
    assert "zml serve" not in r.text and r.json()["error"]["code"] == "MODEL_NOT_LOADED"


def test_models_nodes_and_healthz(http: httpx.Client, zml_stack: Stack) -> None:
    health = http.get("/healthz").json()
    assert health["status"] == "ok" and len(health["gateway"]) == 12, health
    ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert MODEL in ids and MODEL_2 in ids
    nodes = http.get("/v1/nodes").json()["nodes"]
    assert sorted(n["node_id"] for n in nodes) == sorted(zml_stack.node_ids)
    assert all(n["status"] == "up" for n in nodes)
    assert http.get("/nope").status_code == 404
    assert http.get("/v1/chat/completions").status_code == 405


def test_head_is_get_without_the_body(http: httpx.Client) -> None:
    """HEAD on every GET route (load balancers probe /healthz so): GET's status and headers,
    content-length included, and no body; still 405 on the POST routes."""
    for path in ("/healthz", "/v1/models", "/v1/nodes", "/v1/models/" + MODEL, "/v1/models/nope"):
        got, head = http.get(path), http.head(path)
        assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
        assert head.content == b"" and head.headers["content-length"].isdigit(), path
        if path != "/v1/nodes":  # the node table's ages change from one call to the next
            assert head.headers["content-length"] == str(len(got.content)), path
        assert head.headers["content-type"] == got.headers["content-type"]
    assert http.head("/v1/chat/completions").status_code == 405
    assert http.get("/healthz").status_code == 200  # the connection goes on after HEADs


def test_openai_client_against_the_gateway(zml_stack: Stack) -> None:
    import openai

    client = openai.OpenAI(base_url=zml_stack.gateway_url + "/v1", api_key="unused", max_retries=0)
    try:
        resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6)  # type: ignore[arg-type]
        assert resp.choices[0].message.content
        assert resp.usage is not None and resp.usage.completion_tokens == 6
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert raw.headers["x-zml-node-id"] in zml_stack.node_ids
        stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, stream=True)  # type: ignore[arg-type]
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces).strip()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=CHAT)  # type: ignore[arg-type]
    finally:
        client.close()
