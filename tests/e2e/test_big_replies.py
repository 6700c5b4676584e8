"""Replies larger than NATS's max_payload are delivered (issue 9), through the object store,
to the HTTP gateway and to the SDK's NATS transport. A broker with an 8 KiB max_payload makes
an ordinary completion "large"."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from conftest import LLAMA3_POLICY, MODEL, Stack, launch_stack
from zmlcore.launch import free_port, nats_server_binary, spawn, wait_port

CHAT = [{"role": "user", "content": "write a long story"}]


@pytest.fixture(scope="module")
def small_payload_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("bigreply")
    port = free_port()
    conf = tmp / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\nmax_payload: 8192\njetstream {{ store_dir: "{tmp / "js"}" }}\n')
    nats_proc = spawn("nats-small", [nats_server_binary(), "-c", str(conf)])
    try:
        assert wait_port("127.0.0.1", port, 15), nats_proc.tail()
        stack = launch_stack(f"nats://127.0.0.1:{port}", tmp, routers=1, extra=LLAMA3_POLICY)
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        nats_proc.stop()


def test_http_reply_over_max_payload_is_delivered(small_payload_stack: Stack) -> None:
    with httpx.Client(base_url=small_payload_stack.gateway_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3000})
        assert r.status_code == 200, r.text[:300]
        assert len(r.content) > 8192
        body = r.json()
        assert body["usage"]["completion_tokens"] == 3000 and body["zml"]["node_id"]
        # The body limit follows the broker's max_payload: 413, not a 500.
        big = c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 9000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "REQUEST_TOO_LARGE"


def test_sdk_nats_reply_over_max_payload_is_delivered(small_payload_stack: Stack) -> None:
    import zml

    with zml.Client(endpoint=small_payload_stack.nats_url) as client:
        result = client.infer(MODEL, "write a long story", max_tokens=3000)
    assert len(result.text) > 8192 and result.metadata.accelerator_id
