"""Replies larger than NATS's max_payload (issue 9), with authorization on as `zml up` runs it.

A sim node answers an embeddings request of 500 inputs with ~3.7 MB, over the broker's 1 MiB
max_payload. The router sends it in parts on the requester's own inbox (zmlcore.reply.bigreply), and
it reaches every way in: HTTP through the gateway, the SDK over NATS with a *client* identity
(sync and async), and a raw nats-py client identity that declares ``Zml-Accept-Parts``. A raw
client that does not declare it is refused with REPLY_TOO_LARGE before the node runs (the
node's counters do not move); when a node answers far more than the request's bound (a tiny
HTTP node that ignores max_tokens), such a client gets REPLY_TOO_LARGE after the work, never
silence. Lost parts: tests/e2e/test_reply_parts_lost.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

import zml
from conftest import MODEL, SecureBus, Stack, launch_stack
from zmlcore import subjects
from zmlcore.config import NatsConfig
from zmlcore.runtime.launch import free_port
from zmlcore.access.identity import connect_options

EMBED = "BAAI/bge-small-en-v1.5"
N = 500  # x 384 floats as JSON: ~3.7 MB
INPUTS = [f"text {i}" for i in range(N)]
BIG = {"model": EMBED, "input": INPUTS}
NODE = "h100-big"


#: A tiny OpenAI-compatible node that ignores max_tokens: its reply is far over any bound.
WORDY = "wordy/model"
WORDY_TEXT = "y" * 2_500_000


class _Wordy(BaseHTTPRequestHandler):
    calls = 0

    def _json(self, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": WORDY, "object": "model"}]})
        else:
            self.send_error(404)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", "0")))
        type(self).calls += 1
        self._json({"id": "w", "object": "chat.completion", "model": WORDY,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": WORDY_TEXT},
                                 "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def wordy_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Wordy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def stack(secure_bus: SecureBus, wordy_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    secure_bus.issue("carol")
    wordy = (f'[[nodes]]\nid = "wordy-1"\naccelerator = "nvidia_h100"\nbackend = "openai"\n'
             f'endpoint = "http://127.0.0.1:{wordy_port}"\nmodels = ["{WORDY}"]\n')
    s = launch_stack(secure_bus.url, tmp_path_factory.mktemp("big-replies"), routers=1,
                     fleet=[(NODE, "nvidia_h100", [MODEL, EMBED])], identities=secure_bus.seeds,
                     extra=f'[models."{EMBED}"]\nembedding = true\n' + wordy)
    try:
        yield s
    finally:
        s.stop()


def _check_vectors(data: list[Any]) -> None:
    assert len(data) == N and [d["index"] for d in data] == list(range(N))
    assert all(len(d["embedding"]) == 384 for d in data)


def test_http_client_gets_a_reply_of_several_mib(stack: Stack) -> None:
    r = httpx.post(stack.gateway_url + "/v1/embeddings", json=BIG, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 3 * 1024 * 1024
    _check_vectors(r.json()["data"])
    assert r.headers["x-zml-node-id"] == NODE


def test_sdk_over_nats_with_a_client_identity_sync(stack: Stack, secure_bus: SecureBus,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_NATS_NKEY", secure_bus.seeds["carol"])
    with zml.Client(secure_bus.url, timeout=60, max_retries=0) as client:
        r = client.embed(EMBED, INPUTS)
    assert len(r.embeddings) == N and all(len(v) == 384 for v in r.embeddings)
    assert r.routing.node_id == NODE


async def test_sdk_over_nats_with_a_client_identity_async(stack: Stack, secure_bus: SecureBus,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_NATS_NKEY", secure_bus.seeds["carol"])
    async with zml.AsyncClient(secure_bus.url, timeout=60, max_retries=0) as client:
        r = await client.embed(EMBED, INPUTS)
    assert len(r.embeddings) == N and r.routing.node_id == NODE


async def _connect(bus: SecureBus) -> nats.NATS:
    opts = connect_options(NatsConfig(url=bus.url), seed_file=bus.seeds["carol"])
    return await nats.connect(bus.url, allow_reconnect=False, connect_timeout=5, **opts)


async def test_raw_nats_client_that_declares_parts_collects_them(stack: Stack, secure_bus: SecureBus) -> None:
    nc = await _connect(secure_bus)
    try:
        # What docs/security.md shows raw clients: declare, then collect Zml-Part 1..n in order.
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("zml.infer", json.dumps(BIG).encode(), reply=inbox,
                         headers={"Zml-Accept-Parts": str(64 * 1024 * 1024)})
        first = await sub.next_msg(timeout=60)
        assert "Zml-Error-Code" not in (first.headers or {}), first.data[:300]
        n = int(first.headers["Zml-Parts"])
        parts = [first.data]
        for k in range(2, n + 1):
            msg = await sub.next_msg(timeout=10)
            assert int(msg.headers["Zml-Part"]) == k  # a skipped number: a part was lost
            parts.append(msg.data)
        await sub.unsubscribe()
        assert n >= 4 and all(len(p) <= nc.max_payload for p in parts)
        body = json.loads(b"".join(parts))
        _check_vectors(body["data"])
        assert first.headers[subjects.H_NODE_ID] == NODE and body["zml"]["node_id"] == NODE
    finally:
        await nc.close()


async def test_the_docs_example_collects_parts(stack: Stack, secure_bus: SecureBus) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "nats-api.md").read_text()
    code = re.search(r"## Replies larger than max_payload\n.*?```python\n(.*?)```", doc, re.S).group(1)  # type: ignore[union-attr]
    ns: dict[str, Any] = {}
    exec(compile(code, "docs/nats-api.md", "exec"), ns)  # noqa: S102 - the docs' own example, as written
    nc = await _connect(secure_bus)
    try:
        body = await ns["infer_big"](nc, BIG)
    finally:
        await nc.close()
    _check_vectors(body["data"])


def _served(stack: Stack) -> int:
    counters = stack.sim_state(NODE)["counters"]
    return sum(sum(c["success"].values()) + c["failed"] for c in counters.values())


@pytest.mark.parametrize("body", [
    BIG,
    # 300 choices of up to 1,000 tokens could be ~2.5 MB
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "n": 300},
], ids=["embeddings", "chat-n"])
async def test_raw_client_that_does_not_declare_parts_is_refused_before_the_node_runs(
        stack: Stack, secure_bus: SecureBus, body: dict[str, Any]) -> None:
    before = _served(stack)
    nc = await _connect(secure_bus)
    try:
        reply = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=30)
        assert (reply.headers or {}).get(subjects.H_ERROR_CODE) == "REPLY_TOO_LARGE", reply.data[:300]
        err = json.loads(reply.data)["error"]
        assert subjects.H_ACCEPT_PARTS in err["message"] and len(reply.data) < 2000
        # The same client, asking for a reply that fits, is served.
        small = await nc.request(subjects.INFER, json.dumps({**BIG, "input": INPUTS[:5]}).encode(), timeout=30)
        assert subjects.H_ERROR_CODE not in (small.headers or {}), small.data[:300]
    finally:
        await nc.close()
    await asyncio.sleep(0.5)  # nothing is in flight; give a wrongly dispatched request time to count
    assert _served(stack) == before + 1  # only the small request reached the node


def _wordy_up(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nodes = httpx.get(stack.gateway_url + "/v1/nodes", timeout=5).json()["nodes"]
        if any(n["node_id"] == "wordy-1" and n.get("status") == "up" for n in nodes):
            return
        time.sleep(0.2)
    raise AssertionError(f"wordy-1 not up: {nodes}")


async def test_a_reply_bigger_than_its_bound_is_an_error_to_an_undeclared_raw_client_not_silence(
        stack: Stack, secure_bus: SecureBus) -> None:
    await asyncio.to_thread(_wordy_up, stack)
    body = json.dumps({"model": WORDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    before = _Wordy.calls
    nc = await _connect(secure_bus)
    try:  # max_tokens 4 passes the bound; the node then answers 2.5 MB anyway
        reply = await nc.request(subjects.INFER, body, timeout=30)
    finally:
        await nc.close()
    assert _Wordy.calls == before + 1
    assert (reply.headers or {}).get(subjects.H_ERROR_CODE) == "REPLY_TOO_LARGE", reply.data[:300]
    assert subjects.H_ACCEPT_PARTS in json.loads(reply.data)["error"]["message"]
    # The gateway declares parts: the same request gets the whole reply.
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(stack.gateway_url + "/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == WORDY_TEXT
