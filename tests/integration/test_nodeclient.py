"""The router's node HTTP client (zml_router.node.client under zml_router.node.dispatch) against real
local HTTP servers: keep-alive reuse, the pool's bound, every framing, streams, TLS, and
hostile or broken node replies (each a clean AttemptError / ReplyTooLargeError, and a
connection never reused half-read)."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from zml_router.node.dispatch import NodeClient, post_json, stream_sse
from zml_router.node.attempt import AttemptError, Failure
from zml_router.node.client import MAX_HEAD_BYTES, MAX_HEADERS
from zml_router.timers import Wheel
from zmlcore.errors import ReplyTooLargeError

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b'{"ok":true}'


def ok(body: bytes = OK, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n" % (
        len(body), extra) + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


class Node:
    """A raw asyncio HTTP/1.1 server: reads each request (head + content-length body) on a
    kept-alive connection and hands it to ``handler``, which writes whatever it likes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # set whenever a connection ends (read EOF or reset)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line[15:])
                await reader.readexactly(n)
                self.requests.append(head)
                await self.handler(head, reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            self.closed.set()
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[tuple[Node, str]]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, ssl_ctx: ssl.SSLContext | None = None) -> tuple[Node, str]:
        node = Node(handler)
        srv = await asyncio.start_server(node.serve, "127.0.0.1", 0, ssl=ssl_ctx)
        servers.append(srv)
        port = srv.sockets[0].getsockname()[1]
        return node, f"{'https' if ssl_ctx else 'http'}://127.0.0.1:{port}/v1/chat/completions"

    yield start
    for srv in servers:
        srv.close()


@pytest.fixture
async def client() -> AsyncIterator[NodeClient]:
    c = NodeClient(8, 5)
    yield c
    await c.aclose()


def replying(data: bytes, close: bool = False) -> Handler:
    async def handler(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()
    return handler


async def test_keep_alive_reuses_one_connection(serve, client) -> None:  # type: ignore[no-untyped-def]
    node, url = await serve(replying(ok()))
    for _ in range(5):
        assert await post_json(client, url, b"{}", {"x-request-id": "r1"}) == OK
    assert node.connections == 1
    head = node.requests[0].lower()
    assert head.startswith(b"post /v1/chat/completions http/1.1\r\n")
    assert b"x-request-id: r1\r\n" in head and b"content-length: 2\r\n" in head
    assert b"accept-encoding: identity\r\n" in head


async def test_chunked_and_close_delimited_replies(serve, client) -> None:  # type: ignore[no-untyped-def]
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    node, url = await serve(replying(head + chunked(b'{"a":', b'1}')))
    assert await post_json(client, url, b"{}", {}) == b'{"a":1}'
    assert await post_json(client, url, b"{}", {}) == b'{"a":1}'
    assert node.connections == 1
    node2, url2 = await serve(replying(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + OK, close=True))
    assert await post_json(client, url2, b"{}", {}) == OK
    assert await post_json(client, url2, b"{}", {}) == OK
    assert node2.connections == 2  # not kept: the node said close


async def test_informational_reply_is_skipped(serve, client) -> None:  # type: ignore[no-untyped-def]
    _, url = await serve(replying(b"HTTP/1.1 100 Continue\r\n\r\n" + ok()))
    assert await post_json(client, url, b"{}", {}) == OK


async def test_errors_are_classified_with_retry_after(serve, client) -> None:  # type: ignore[no-untyped-def]
    body = b'{"error":"busy"}'
    _, url = await serve(replying(b"HTTP/1.1 503 Busy\r\nretry-after: 3\r\ncontent-length: %d\r\n\r\n" % len(body)
                                  + body))
    with pytest.raises(AttemptError) as info:
        await post_json(client, url, b"{}", {})
    assert (info.value.failure, info.value.status, info.value.retry_after) == (Failure.OVERLOADED, 503, 3.0)
    assert info.value.detail == body.decode()


async def test_the_pool_is_bounded(serve) -> None:  # type: ignore[no-untyped-def]
    async def slow(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.05)
        writer.write(ok())

    node, url = await serve(slow)
    c = NodeClient(2, 5)
    try:
        replies = await asyncio.gather(*(post_json(c, url, b"{}", {}) for _ in range(10)))
        assert replies == [OK] * 10
        assert node.max_open <= 2
        assert node.connections == 2
    finally:
        await c.aclose()


async def test_an_idle_connection_the_node_closed_is_not_reused(serve, client) -> None:  # type: ignore[no-untyped-def]
    # The node keeps no connection past its reply, without saying so (a keep-alive timeout).
    node, url = await serve(replying(ok(), close=True))
    assert await post_json(client, url, b"{}", {}) == OK
    await asyncio.wait_for(node.closed.wait(), 10)
    await asyncio.sleep(0.05)  # let the client see the close... or not: both must work
    assert await post_json(client, url, b"{}", {}) == OK
    assert node.connections == 2


async def test_stale_connection_retry_when_the_close_is_not_yet_seen(serve) -> None:  # type: ignore[no-untyped-def]
    """The node drops the idle connection as the request goes out: no byte of reply, so it is
    sent again, once, on a new connection."""
    calls = 0

    async def drop_second(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            writer.transport.abort()
            return
        writer.write(ok())

    node, url = await serve(drop_second)
    c = NodeClient(4, 5)
    try:
        assert await post_json(c, url, b"{}", {}) == OK
        assert await post_json(c, url, b"{}", {}) == OK
        assert node.connections == 2 and calls == 3
    finally:
        await c.aclose()


async def test_a_fresh_connection_that_drops_is_a_network_failure(serve, client) -> None:  # type: ignore[no-untyped-def]
    async def drop(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    node, url = await serve(drop)
    with pytest.raises(AttemptError) as info:
        await post_json(client, url, b"{}", {})
    assert info.value.failure is Failure.NETWORK
    assert node.connections == 1  # a fresh connection is not retried


async def test_connection_refused_is_a_network_failure(client) -> None:  # type: ignore[no-untyped-def]
    from zmlcore.runtime.launch import free_port

    with pytest.raises(AttemptError) as info:
        await post_json(client, f"http://127.0.0.1:{free_port()}/v1/chat/completions", b"{}", {})
    assert info.value.failure is Failure.NETWORK


async def test_an_oversize_body_is_refused_and_its_connection_dropped(serve, client) -> None:  # type: ignore
    node, url = await serve(replying(ok(b"x" * 100_000)))
    with pytest.raises(ReplyTooLargeError):
        await post_json(client, url, b"{}", {}, max_bytes=10_000)
    await asyncio.wait_for(node.closed.wait(), 10)
    assert await post_json(client, url, b"{}", {}, max_bytes=200_000) == b"x" * 100_000
    assert node.connections == 2


@pytest.mark.parametrize("reply", [
    pytest.param(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n", id="giant-header"),
    pytest.param(b"HTTP/1.1 200 OK\r\n" + b"x-h: 1\r\n" * (MAX_HEADERS + 1) + b"content-length: 0\r\n\r\n",
                 id="too-many-headers"),
    pytest.param(b"HTTP/1.1 200 OK\r\n" + b"x-h: 1\r\n" * 5000, id="endless-head"),
    pytest.param(b"HTTP/1.1 2OO OK\r\ncontent-length: 0\r\n\r\n", id="malformed-status"),
    pytest.param(b"SPDY/9 200 OK\r\n\r\n", id="not-http"),
    pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10, id="early-close-mid-body"),
    pytest.param(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", id="bad-chunk-size"),
    pytest.param(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", id="chunk-overrun"),
    pytest.param(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab", id="early-close-mid-chunk"),
    pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}", id="two-lengths"),
    pytest.param(b"", id="close-without-reply"),
])
async def test_broken_replies_are_network_failures(serve, client, reply: bytes) -> None:  # type: ignore[no-untyped-def]
    node, url = await serve(replying(reply, close=True))
    for call in (lambda: post_json(client, url, b"{}", {}), lambda: _drain_stream(client, url)):
        with pytest.raises(AttemptError) as info:
            await asyncio.wait_for(call(), 10)
        assert info.value.failure is Failure.NETWORK, info.value
    assert client.http()._open == 0  # nothing kept of a broken connection


async def _drain_stream(client: NodeClient, url: str) -> list[bytes]:
    return [c async for c in stream_sse(client, url, b"{}", {}, relay=True)]


async def test_slowloris_head_is_cut_by_the_first_byte_deadline(serve, client) -> None:  # type: ignore[no-untyped-def]
    async def dribble(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(600):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)

    node, url = await serve(dribble)
    with pytest.raises(TimeoutError):  # as zml_router.node.relay times a whole reply's first byte
        with Wheel().deadline(0.5):
            await post_json(client, url, b"{}", {})
    await asyncio.wait_for(node.closed.wait(), 10)  # the client hung up
    assert client.http()._open == 0


SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_sse_is_relayed_and_the_connection_kept(serve, client) -> None:  # type: ignore[no-untyped-def]
    async def events(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE)
        for i in range(3):
            writer.write(chunked(b'data: {"i":%d}\n\n' % i)[:-5])
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(chunked(b"data: [DONE]\n\n"))

    node, url = await serve(events)
    blocks = await _drain_stream(client, url)
    assert b"".join(blocks) == b'data: {"i":0}\n\ndata: {"i":1}\n\ndata: {"i":2}\n\n'
    payloads = [c async for c in stream_sse(client, url, b"{}", {})]
    assert payloads == [b'{"i":0}', b'{"i":1}', b'{"i":2}']
    assert node.connections == 1


async def test_a_stream_abandoned_mid_body_closes_its_connection(serve, client) -> None:  # type: ignore
    async def endless(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE)
        while True:
            writer.write(chunked(b'data: {"a":1}\n\n')[:-5])
            await writer.drain()
            await asyncio.sleep(0.01)

    node, url = await serve(endless)

    async def read_two() -> None:
        async for _ in stream_sse(client, url, b"{}", {}, relay=True):
            await asyncio.sleep(0.05)

    task = asyncio.create_task(read_two())
    await asyncio.sleep(0.3)
    task.cancel()  # the requester went away
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(node.closed.wait(), 10)
    assert client.http()._open == 0


async def test_a_stream_over_the_line_bound_is_a_server_failure(serve, client) -> None:  # type: ignore[no-untyped-def]
    from zmlcore.reply import sse

    async def long_line(head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE)
        try:
            for _ in range(sse.MAX_LINE_BYTES // 65536 + 4):
                writer.write(chunked(b"data: " + b"x" * 65536)[:-5])
                await writer.drain()
        except ConnectionError:
            pass

    _, url = await serve(long_line)
    with pytest.raises(AttemptError) as info:
        await asyncio.wait_for(_drain_stream(client, url), 30)
    assert info.value.failure is Failure.SERVER


def _self_signed() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    import tempfile

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/c.pem", "wb") as f:
            f.write(pem)
        with open(f"{d}/k.pem", "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(f"{d}/c.pem", f"{d}/k.pem")
    client = ssl.create_default_context(cadata=pem.decode())
    return server, client


async def test_https_nodes(serve) -> None:  # type: ignore[no-untyped-def]
    server_ctx, client_ctx = _self_signed()
    node, url = await serve(replying(ok()), server_ctx)
    c = NodeClient(4, 5, ssl_context=client_ctx)
    try:
        assert await post_json(c, url, b"{}", {}) == OK
        assert await post_json(c, url, b"{}", {}) == OK
        assert node.connections == 1
    finally:
        await c.aclose()
    untrusted = NodeClient(4, 5)  # the system's CAs: the self-signed node is refused
    try:
        with pytest.raises(AttemptError) as info:
            await post_json(untrusted, url, b"{}", {})
        assert info.value.failure is Failure.NETWORK
    finally:
        await untrusted.aclose()
