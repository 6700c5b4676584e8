"""A node's reply is hostile input too: the router reads at most what a requester can take
(``[nats] max_reply_bytes``) and only the head of an error body, over a real HTTP server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from zml_router.node.dispatch import MAX_ERROR_BODY, NodeClient, post_json
from zml_router.node.attempt import AttemptError, Failure
from zmlcore.errors import ReplyTooLargeError
from zmlcore.runtime.launch import free_port


@pytest.fixture
async def node() -> AsyncIterator[tuple[str, dict[str, int]]]:
    sent = {"bytes": 0}

    async def huge(request: web.Request) -> web.StreamResponse:
        status = int(request.query.get("status", "200"))
        resp = web.StreamResponse(status=status, headers={"content-type": "application/json"})
        await resp.prepare(request)
        chunk = b"x" * 65536
        try:
            for _ in range(int(request.query.get("chunks", "1"))):
                await resp.write(chunk)
                sent["bytes"] += len(chunk)
        except (ConnectionResetError, RuntimeError):
            pass  # the router stopped reading: what we want
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", sent
    finally:
        await runner.cleanup()


async def test_a_reply_within_the_bound_is_read_whole(node: tuple[str, dict[str, int]]) -> None:
    url, _ = node
    client = NodeClient(4, 5)
    try:
        body = await post_json(client, url + "?chunks=4", b"{}", {}, max_bytes=4 * 65536)
        assert len(body) == 4 * 65536
    finally:
        await client.aclose()


async def test_a_reply_over_the_bound_is_refused_without_reading_it_all(node: tuple[str, dict[str, int]]) -> None:
    url, sent = node
    client = NodeClient(4, 5)
    try:
        with pytest.raises(ReplyTooLargeError):
            await post_json(client, url + "?chunks=2000", b"{}", {}, max_bytes=1024 * 1024)  # 128 MiB offered
        assert sent["bytes"] < 64 * 1024 * 1024  # it stopped reading long before the end
    finally:
        await client.aclose()


async def test_only_the_head_of_an_error_body_is_read(node: tuple[str, dict[str, int]]) -> None:
    url, _ = node
    client = NodeClient(4, 5)
    try:
        with pytest.raises(AttemptError) as info:
            await post_json(client, url + "?status=500&chunks=200", b"{}", {})  # 12.5 MiB of error
        assert info.value.failure is Failure.SERVER
        assert len(info.value.detail) <= MAX_ERROR_BODY
    finally:
        await client.aclose()
