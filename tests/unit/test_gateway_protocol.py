"""zml_gateway.protocol on a recording transport (no sockets): a fixed-length reply is one write,
a stream's head is not held back past the turn of the event loop in which it was sent (it goes
with its first chunk when that comes in the same turn), the app hears of a lost client through a callback, and the
head timer (one per connection, not one per request) still cuts off a slow head on a kept-alive
connection."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from zml_gateway.protocol import BoundedHttpTools, FastCycle

REQUEST = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connect(app: Any, header_timeout_s: float = 10.0) -> tuple[BoundedHttpTools, Recorder]:
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)  # as the gateway runs
    config.load()
    cls = BoundedHttpTools.with_limits(16 * 1024, 100, header_timeout_s, None)
    proto = cls(config=config, server_state=ServerState(), app_state={})
    transport = Recorder()
    proto.connection_made(transport)
    return proto, transport


def written(proto: BoundedHttpTools, transport: Recorder) -> bytes:
    """What went out on the connection, uvicorn's default headers (its date) left out: the two
    ways of building a head compared byte for byte."""
    default = proto.server_state.default_headers
    return b"".join(transport.writes).replace(default[0][1] if default else b"", b"")


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_a_reply_with_its_length_goes_out_in_one_write() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")]})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})

    proto, transport = connect(app)
    for _ in range(2):  # and again on the kept-alive connection
        transport.writes.clear()
        proto.data_received(REQUEST)
        await settle()
        assert len(transport.writes) == 1, transport.writes
        head, _, body = transport.writes[0].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: 11" in head and b"chunked" not in head
        assert body == b'{"ok":true}'
    assert isinstance(proto.cycle, FastCycle) and proto.cycle.response_complete


async def test_a_stream_head_is_written_at_once_and_checks_still_apply() -> None:
    started = asyncio.Event()
    go_on = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        started.set()
        await go_on.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    proto, transport = connect(app)
    proto.data_received(REQUEST)
    await asyncio.wait_for(started.wait(), 5)
    assert len(transport.writes) == 1 and transport.writes[0].startswith(b"HTTP/1.1 200")  # not held back
    go_on.set()
    await settle()
    assert b"data: 1" in b"".join(transport.writes[1:])

    async def bad(scope: Any, receive: Any, send: Any) -> None:  # uvicorn's header checks still run
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-bad", b"a\r\nset-cookie: x"), (b"content-length", b"0")]})

    proto, transport = connect(bad)
    proto.data_received(REQUEST)
    await settle()
    assert b"set-cookie" not in b"".join(transport.writes)


HEADS = [
    [(b"content-type", b"application/json"), (b"content-length", b"2")],
    [(b"content-type", b"application/json"), (b"content-length", b"2"), (b"x-zml-node-id", b"n1"),
     (b"x-zml-label", b"%C3%A9quipe"), (b"x-ratelimit-remaining-requests", b"9"), (b"retry-after", b"1")],
    [(b"Content-Length", b"2"), (b"X-Upper", b"v")],  # upper-case names: uvicorn's head
    [(b"content-length", b"2"), (b"connection", b"close")],  # uvicorn's head (it closes)
    [(b"content-length", b"2"), (b"x-tab", b"a\tb")],  # a tab is a valid value byte
]


async def test_the_head_built_here_is_the_one_uvicorn_writes(monkeypatch: Any) -> None:
    for headers in HEADS:
        for status in (200, 429):
            async def app(scope: Any, receive: Any, send: Any, headers: Any = headers, status: int = status) -> None:
                await receive()
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": b"{}"})

            got = []
            for fast in (True, False):
                if not fast:
                    monkeypatch.setattr(FastCycle, "_whole_head", lambda self, message: None)
                proto, transport = connect(app)
                proto.data_received(REQUEST)
                await settle()
                got.append(written(proto, transport))
                assert len(transport.writes) == 1 and proto.cycle.response_complete
                monkeypatch.undo()
            assert got[0] == got[1], headers


STREAM_HEADS = [
    [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-zml-node-id", b"n1"),
     (b"x-zml-label", b"%C3%A9quipe"), (b"x-ratelimit-remaining-requests", b"9")],
    [(b"content-type", b"text/event-stream"), (b"connection", b"close")],  # uvicorn's head (it closes)
    [(b"Content-Type", b"text/event-stream")],  # upper-case names: uvicorn's head
]


async def test_a_stream_head_built_here_is_the_one_uvicorn_writes_and_goes_with_the_first_chunk(
        monkeypatch: Any) -> None:
    for headers in STREAM_HEADS:
        async def app(scope: Any, receive: Any, send: Any, headers: Any = headers) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

        got = []
        for fast in (True, False):
            if not fast:
                monkeypatch.setattr(FastCycle, "_whole_head", lambda self, message: None)
            proto, transport = connect(app)
            proto.data_received(REQUEST)
            await settle()
            got.append(written(proto, transport))
            assert proto.cycle.response_complete
            if fast and headers is STREAM_HEADS[0]:  # the head and its first chunk: one write
                assert len(transport.writes) == 2 and transport.writes[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
            monkeypatch.undo()
        assert got[0] == got[1], headers
        assert b"transfer-encoding: chunked" in got[0] and got[0].endswith(b"0\r\n\r\n")


async def test_an_invalid_head_with_a_length_is_refused_as_uvicorn_refuses_it() -> None:
    for headers in ([(b"x-bad", b"a\r\nset-cookie: x"), (b"content-length", b"2")],
                    [(b"x bad", b"v"), (b"content-length", b"2")]):
        async def bad(scope: Any, receive: Any, send: Any, headers: Any = headers) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"{}"})

        proto, transport = connect(bad)
        proto.data_received(REQUEST)
        await settle()
        assert b"set-cookie" not in b"".join(transport.writes) and b"x bad" not in b"".join(transport.writes)
        assert b"HTTP/1.1 200" not in b"".join(transport.writes) and transport.closed  # as uvicorn does


async def test_a_short_body_is_refused_as_uvicorn_does() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"short"})

    proto, transport = connect(app)
    proto.data_received(REQUEST)
    await settle()
    assert transport.closed  # "Response content shorter than Content-Length": the connection goes
    assert not proto.cycle.response_complete


async def test_the_app_is_called_back_when_the_client_goes() -> None:
    gone: list[str] = []
    hooked = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        receive.__self__.on_disconnect(lambda: gone.append("first"))
        off = receive.__self__.on_disconnect(lambda: gone.append("cancelled"))
        off()
        hooked.set()
        await asyncio.sleep(30)

    proto, transport = connect(app)
    proto.data_received(REQUEST)
    await asyncio.wait_for(hooked.wait(), 5)
    assert gone == []
    proto.connection_lost(None)
    assert gone == ["first"]
    late: list[int] = []
    proto.cycle.on_disconnect(lambda: late.append(1))  # asked after the loss: called at once
    assert late == [1]
    for task in list(proto.tasks):
        task.cancel()
    await settle()


async def test_a_slow_head_on_a_kept_alive_connection_is_cut_off_on_time() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    loop = asyncio.get_running_loop()
    proto, transport = connect(app, header_timeout_s=0.3)
    await asyncio.sleep(0.2)
    proto.data_received(REQUEST)  # the first head, on time (its timer stays armed)
    await settle()
    assert transport.writes and transport.writes[0].startswith(b"HTTP/1.1 200")
    t0 = loop.time()
    proto.data_received(b"POST /x HTTP/1.1\r\nHost: t\r\n")  # a second head that stalls
    while not transport.closed and loop.time() - t0 < 8:
        await asyncio.sleep(0.01)
    assert transport.writes[-1].startswith(b"HTTP/1.1 408")
    waited = loop.time() - t0
    assert 0.25 <= waited < 6.0, waited  # its own 0.3 s, not the ~0.1 s left of the first one's


async def test_the_cycle_says_when_the_whole_body_is_here() -> None:
    seen: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(receive.__self__.body_complete)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    proto, transport = connect(app)
    proto.data_received(REQUEST)  # head and body in one read
    await settle()
    proto.data_received(REQUEST[:-1])  # the body's last byte not here yet
    await settle()
    proto.data_received(REQUEST[-1:])
    await settle()
    assert seen == [True, False]


async def test_the_gateway_reads_a_body_that_is_all_here_without_a_timer(tmp_path: Any) -> None:
    """The body of a small request comes with its head: reading it arms no timer; a body still
    on its way is read under body_timeout_s as before."""
    from types import SimpleNamespace

    from zmlcore.config import load_config
    from zml_gateway.app import Gateway

    path = tmp_path / "zml.toml"
    path.write_text('[[nodes]]\nid = "n1"\naccelerator = "nvidia_h100"\nendpoint = "http://127.0.0.1:9"\n'
                    'backend = "openai"\nmodels = ["m"]\n')
    gw = Gateway(load_config(str(path), env={}), SimpleNamespace(max_payload=1 << 20), {})  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_at = loop.call_at

    def counting(when: float, cb: Any, *args: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, cb, *args)

    class Cycle:
        def __init__(self, complete: bool) -> None:
            self.body_complete = complete

        async def receive(self) -> dict[str, Any]:
            return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"headers": [(b"content-length", b"2")]}
    loop.call_at = counting  # type: ignore[method-assign]
    try:
        assert await gw.intake.read_body(scope, Cycle(True).receive) == b"{}"
        assert armed == []
        assert await gw.intake.read_body(scope, Cycle(False).receive) == b"{}"
        assert len(armed) == 1  # asyncio.timeout's
    finally:
        del loop.call_at  # type: ignore[attr-defined]
